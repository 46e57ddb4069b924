"""Rule rewards (math-verify) on hand-written cases."""

from hf_verl.rewards.rules import gsm8k_accuracy, gsm8k_final_number, math_accuracy


def test_gsm8k_accuracy():
    gold = ["Natalia sold 48/2 = 24 clips.\n#### 1,072", "#### 5", "no gold marker"]
    comps = ["so the total is 1072.", [{"role": "assistant", "content": "I think 4"}], "7"]
    assert gsm8k_accuracy(comps, answer=gold) == [1.0, 0.0, None]
    assert gsm8k_final_number("a 3 b #### 12") == "12"


def test_math_accuracy_symbolic():
    out = math_accuracy(["the answer is $\\frac{1}{2}$", "it is 3", "x"], solution=["0.5", "$4$", "no"])
    assert out[:2] == [1.0, 0.0]
    assert out[2] is None
