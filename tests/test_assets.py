"""The embedded tiny target and draft: they load with stock transformers, generate, share a tokenizer whose
chat template marks assistant tokens, ship inside the wheel, and have learned something real."""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mtp_train.data import stdlib
from mtp_train.lm_eval import next_token_metrics, unigram_metrics, windows

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    return AutoTokenizer.from_pretrained(tiny_dir / "target")


@pytest.fixture(scope="module")
def target(tiny_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_dir / "target", dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def draft(tiny_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_dir / "draft", dtype=torch.float32).eval()


def test_architectures(target, draft, tokenizer):
    t, d = target.config, draft.config
    assert t.model_type == d.model_type == "llama"
    assert (t.num_hidden_layers, t.hidden_size, t.num_attention_heads, t.num_key_value_heads) == (4, 256, 4, 2)
    assert t.tie_word_embeddings is False  # separate embed_tokens and lm_head, as in Llama 3.1 8B/70B
    assert d.num_hidden_layers <= 2 and d.hidden_size < t.hidden_size
    assert t.vocab_size == d.vocab_size == len(tokenizer) and 7000 <= len(tokenizer) <= 9000


def test_assets_fit_the_size_budget(tiny_dir):
    total = sum(p.stat().st_size for p in tiny_dir.rglob("*") if p.is_file())
    assert total <= 20 * 2**20, f"{total / 2**20:.1f} MiB"


def test_tokenizer_round_trips(tokenizer, tiny_dir):
    samples = ["def f(x):\n    return x ** 2  # square\n", "naïve café — ünïcödé ✓ 数字\t\r\n", "   \n\n\t",
               stdlib.list_files("validation")[0].read()[:2000]]
    for text in samples:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text
    ids = tokenizer("x = 1")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    draft_tok = AutoTokenizer.from_pretrained(tiny_dir / "draft")
    assert draft_tok.get_vocab() == tokenizer.get_vocab()


def test_chat_template_marks_assistant_content_and_end_of_turn(tokenizer):
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."},
            {"role": "assistant", "content": "hi there"}, {"role": "user", "content": "Again."},
            {"role": "assistant", "content": "hello"}]
    out = tokenizer.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    marked = [i for i, m in zip(ids, mask) if m]
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    expected = (tokenizer("hi there", add_special_tokens=False)["input_ids"] + [eot]
                + tokenizer("hello", add_special_tokens=False)["input_ids"] + [eot])
    assert marked == expected
    prompt = tokenizer.apply_chat_template(conv[:2], add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_generation_prompt_tokenizes_as_a_prefix_of_the_conversation(tokenizer):
    # What the target sees when asked to reply must be what it saw in training before a reply.
    for reply in ("def f(x):\n    return x", "  indented", "42", "x = 1"):
        conv = [{"role": "user", "content": "Write f.\n\n"}, {"role": "assistant", "content": reply}]
        full = tokenizer.apply_chat_template(conv, tokenize=True, return_dict=False)
        prompt = tokenizer.apply_chat_template(conv[:1], add_generation_prompt=True, tokenize=True, return_dict=False)
        assert full[: len(prompt)] == prompt, reply


def test_greedy_generation_is_deterministic(target, draft, tokenizer):
    prompt = "import os\n\n\ndef "
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    for model in (target, draft):
        a = model.generate(ids, max_new_tokens=12, do_sample=False)
        b = model.generate(ids, max_new_tokens=12, do_sample=False)
        assert a.shape[1] == ids.shape[1] + 12 and torch.equal(a, b)
    assert set(target.generation_config.eos_token_id) == {tokenizer.eos_token_id,
                                                         tokenizer.convert_tokens_to_ids("<|eot_id|>")}


def test_heldout_quality_beats_unigram(target, draft, tokenizer, tiny_dir):
    report = json.loads((tiny_dir / "report.json").read_text())
    h = report["heldout"]
    assert h["target"]["top1"] > h["unigram"]["top1"] + 0.15
    assert h["target"]["loss"] < h["draft"]["loss"] < h["unigram"]["loss"]
    # Re-measure on a slice of the validation files: the shipped weights match the report.
    text = "".join(f.read() + tokenizer.eos_token for f in stdlib.list_files("validation")[:6])
    val = windows(tokenizer(text)["input_ids"], 256, max_windows=8)
    got = next_token_metrics(target, val)
    assert got.tokens == 8 * 255
    assert got.top1 > h["unigram"]["top1"] + 0.15 and got.loss < h["unigram"]["loss"] - 1.0


def test_unigram_and_next_token_metrics_are_exact():
    train = torch.tensor([0, 0, 0, 1])  # counts 3, 1, 0 (+1 smoothing -> 4, 2, 1 out of 7)
    batch = torch.tensor([[2, 0, 1]])
    m = unigram_metrics(train, batch, vocab_size=3)
    assert m.tokens == 2 and m.top1 == 0.5
    assert m.loss == pytest.approx(-(torch.tensor(4 / 7).log() + torch.tensor(2 / 7).log()).item() / 2)

    class Fixed(torch.nn.Module):  # predicts token 1 with logit 0 vs -inf-ish for others
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, input_ids, use_cache=False):
            logits = torch.full((*input_ids.shape, 3), -1e4)
            logits[..., 1] = 0.0
            return type("Out", (), {"logits": logits})()

    m = next_token_metrics(Fixed(), batch)
    assert m.tokens == 2 and m.top1 == 0.5 and m.loss == pytest.approx(1e4 / 2, rel=1e-4)


def test_installed_wheel_runs_the_tiny_recipe(tmp_path):
    """Built offline from a copy of the repo, installed into a bare folder, and run from there: the recipes
    and assets must come from the installed package, not from this checkout."""
    src = tmp_path / "src"  # an in-tree build would leave build/ and egg-info in the repo
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for name in ("mtp_train", "recipes"):
        shutil.copytree(REPO / name, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w", str(tmp_path), str(src)],
                   check=True, capture_output=True)
    wheel = next(tmp_path.glob("mtp_train-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for need in ("mtp_train/recipes/tiny.yaml", "mtp_train/recipes/llama3.1-70b.yaml",
                 "mtp_train/assets/tiny/target/model.safetensors", "mtp_train/assets/tiny/target/config.json",
                 "mtp_train/assets/tiny/target/tokenizer.json", "mtp_train/assets/tiny/draft/model.safetensors",
                 "mtp_train/assets/tiny/report.json", "mtp_train/cli.py", "mtp_train/data/stdlib.py"):
        assert need in names, need
    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--no-index", "--quiet", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)
    code = ("import mtp_train, sys; from mtp_train.config import compose; cfg = compose('tiny', ['run_dir=r']); "
            "print(mtp_train.__file__); print(cfg.target.path)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(site)},
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0].startswith(str(site)) and out[1] == str(site / "mtp_train" / "assets" / "tiny" / "target")
