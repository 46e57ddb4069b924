"""Concurrency of `hf-verl serve`: requests per second and p50 / p99 latency for concurrent clients, the
FastAPI server against the standard-library server it replaced, measured in the same run.

Each server runs in a fresh child process of this script on the same saved model (a seeded Llama over the
char tokenizer of the tests, hidden 128, 2 layers by default), one after the other and interleaved over
`--repeats`. The baseline is the earlier `hf_verl/serve/server.py` read from git (`--baseline-rev`, the last
commit that had it; or `--baseline-file`) into a temporary folder and imported only by this script. Against
each server, `--clients` threads (32) each send `--requests` completion requests back to back on one
kept-alive connection (text prompts, `--tokens` new tokens at temperature 1, `--n` choices), after a warm-up
of one request per client; latency is per request, from send to the last byte (with `--stream`, to
`[DONE]`). Requests the baseline fails (its listen backlog resets connections under many clients) are
counted, not fatal; the new server must answer all. Prints one line per run, then the median over repeats per server and the new / old ratios.

Usage: python benchmarks/serve_concurrency.py [--clients 32] [--requests 8] [--tokens 16] [--repeats 3]
                                             [--stream] [--threads 1] [--baseline-rev REV]
Smoke check: python benchmarks/serve_concurrency.py --clients 4 --requests 2 --tokens 4 --repeats 1
"""

from __future__ import annotations

import argparse
import http.client
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BASELINE_REV = "0901959d3572f200a37960c66876ac42ff8daec2"  # the last commit with the stdlib server
WORDS = ["reverse abcde", "what is 2+2?", "hello there", "count to 5", "abc", "the quick fox", "xyz", "a b c"]


def serve(which: str, model_dir: str, port: int, baseline_file: str | None, threads: int) -> None:
    """Child: serve `model_dir` with the new server or the baseline until killed."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_verl.rollout.hf_engine import TransformersEngine

    torch.set_num_threads(threads)
    if which == "old":
        spec = importlib.util.spec_from_file_location("_stdlib_server_baseline", baseline_file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        server_cls = module.RolloutServer
    else:
        from hf_verl.serve.server import RolloutServer as server_cls
    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = TransformersEngine(AutoModelForCausalLM.from_pretrained(model_dir).eval(), tok)
    server_cls(engine, tok, "bench", port=port).serve_forever()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_request(conn: http.client.HTTPConnection, body: bytes, stream: bool) -> None:
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    data = response.read()
    if response.status != 200 or (stream and not data.rstrip().endswith(b"data: [DONE]")):
        raise RuntimeError(f"answer {response.status}: {data[:200]!r}")


def load(port: int, clients: int, requests: int, body: dict) -> tuple[float, list[float], list[str]]:
    """`clients` threads x `requests` each (after one warm-up each); returns wall seconds, latencies, errors."""
    payloads = [json.dumps({**body, "prompt": WORDS[i % len(WORDS)]}).encode() for i in range(clients)]
    latencies, errors, lock = [], [], threading.Lock()
    ready, start = threading.Barrier(clients + 1), threading.Event()

    def client(i: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        try:
            one_request(conn, payloads[i], body["stream"])
        except Exception as err:  # noqa: BLE001 (reported below)
            errors.append(f"warm-up: {err}")
        ready.wait()
        start.wait()
        mine = []
        for _ in range(requests):
            t0 = time.perf_counter()
            try:
                if body["stream"]:  # the baseline closes each stream's connection
                    conn.close()
                one_request(conn, payloads[i], body["stream"])
                mine.append(time.perf_counter() - t0)
            except Exception as err:  # noqa: BLE001
                errors.append(str(err))
                conn.close()
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    ready.wait()
    t0 = time.perf_counter()
    start.set()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, latencies, errors


def run_once(which: str, model_dir: str, args, baseline_file: str | None) -> dict:
    port = free_port()
    cmd = [sys.executable, __file__, "--child-serve", which, "--model-dir", model_dir, "--port", str(port),
           "--threads", str(args.threads)] + (["--baseline-file", baseline_file] if baseline_file else [])
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{which} server did not start: {proc.stderr.read().decode()[-2000:]}")
            time.sleep(0.2)
        body = {"model": "bench", "max_tokens": args.tokens, "temperature": 1.0, "n": args.n, "stream": args.stream}
        wall, latencies, errors = load(port, args.clients, args.requests, body)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    if not latencies or (errors and which == "new"):
        raise RuntimeError(f"{which}: {len(errors)} failed requests, e.g. {errors[:3]}")
    latencies.sort()
    # the stdlib baseline's listen backlog (socketserver's request_queue_size, 5) resets connections under many
    # clients: its failures are counted and reported, its figures are over the requests it answered
    return {"rps": len(latencies) / wall, "p50": statistics.median(latencies),
            "p99": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], "failed": len(errors),
            "first_error": errors[0] if errors else ""}


def baseline_source(args, folder: str) -> str:
    if args.baseline_file:
        return args.baseline_file
    path = os.path.join(folder, "_stdlib_server_baseline.py")
    text = subprocess.run(["git", "show", f"{args.baseline_rev}:hf_verl/serve/server.py"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout
    if "ThreadingHTTPServer" not in text:
        raise SystemExit(f"{args.baseline_rev}:hf_verl/serve/server.py is not the stdlib server; pass --baseline-rev "
                         "or --baseline-file")
    Path(path).write_text(text)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--requests", type=int, default=8, help="Requests per client, after one warm-up request.")
    p.add_argument("--tokens", type=int, default=16, help="max_tokens of each request.")
    p.add_argument("--n", type=int, default=1, help="Choices per request.")
    p.add_argument("--stream", action="store_true", help="Streamed requests (latency to [DONE]).")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--impls", default="new,old", help="Which servers, in order: new (FastAPI), old (stdlib).")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each server process.")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--baseline-rev", default=BASELINE_REV, help="git revision holding the stdlib server.")
    p.add_argument("--baseline-file", default=None, help="The stdlib server as a file (instead of git).")
    p.add_argument("--child-serve", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child_serve:
        serve(args.child_serve, args.model_dir, args.port, args.baseline_file, args.threads)
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.conftest import build_char_tokenizer

    tok = build_char_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
                                         vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                                         eos_token_id=tok.eos_token_id, max_position_embeddings=512))
    impls = args.impls.split(",")
    runs: dict[str, list[dict]] = {which: [] for which in impls}
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        baseline = baseline_source(args, tmp) if "old" in impls else None
        print(f"{args.clients} clients x {args.requests} requests, {args.tokens} tokens, n={args.n}, "
              f"stream={args.stream}, {args.threads} torch thread(s) per server", flush=True)
        for repeat in range(args.repeats):
            for which in impls:
                r = run_once(which, tmp, args, baseline)
                runs[which].append(r)
                print(f"  run {repeat} {which}: {r['rps']:8.2f} req/s  p50 {r['p50'] * 1e3:8.1f} ms  "
                      f"p99 {r['p99'] * 1e3:8.1f} ms  failed {r['failed']}"
                      + (f" (e.g. {r['first_error']})" if r["failed"] else ""), flush=True)
    summary = {which: {k: statistics.median(r[k] for r in rs) for k in ("rps", "p50", "p99", "failed")}
               for which, rs in runs.items()}
    for which, s in summary.items():
        print(f"{which:4s} median: {s['rps']:8.2f} req/s  p50 {s['p50'] * 1e3:8.1f} ms  p99 {s['p99'] * 1e3:8.1f} ms  "
              f"failed {s['failed']:g} of {args.clients * (args.requests + 1)}")
    if {"new", "old"} <= set(summary):
        new, old = summary["new"], summary["old"]
        print(f"new/old: req/s x{new['rps'] / old['rps']:.2f}  p50 x{new['p50'] / old['p50']:.2f}  "
              f"p99 x{new['p99'] / old['p99']:.2f}  (req/s above 1 and latencies below 1 favour the new server)")


if __name__ == "__main__":
    main()
