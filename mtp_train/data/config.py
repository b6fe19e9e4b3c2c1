"""The prepare stage's settings (`data.*`): the sources a recipe reads and how they become samples. Plain dataclasses,
no torch: `mtp_train.config` composes them into the run config."""

from __future__ import annotations

from dataclasses import dataclass, field


# a source's format
FORMATS = ("auto", "sharegpt", "openai", "text", "hf_disk", "stdlib", "stdlib_chat", "target_prompts",
           "sharegpt_v3")
# built-in held-out prompt sets (prompt_sets.py), by role: anything may be chosen on a dev set (validate.prompts,
# `mtp-train validate`); a test set is only reported (validate.test_prompts, `mtp-train test`)
DEV_SETS = ("recipe", "mt-bench", "sharegpt-dev")
TEST_SETS = ("mt-bench-test", "sharegpt-test", "functions-test")
PROMPT_SETS = DEV_SETS + TEST_SETS
REGEN_ENGINES = ("auto", "ours", "vllm")  # data.regen_engine
REGEN_DTYPES = ("auto", "float32", "bfloat16")  # data.regen_dtype


@dataclass
class SourceConfig:
    path: str = "???"  # a file or directory; for stdlib / stdlib_chat, a corpus split (head-train, validation)
    # (target_prompts: any name; the target writes `limit` user prompts itself, synthesize.py)
    # (sharegpt_v3: path `train`, ShareGPT V3's conversations of the train role, sharegpt.py)
    # auto | sharegpt | openai | text | hf_disk | stdlib | stdlib_chat | target_prompts | sharegpt_v3
    format: str = "auto"
    split: str = "auto"  # train | val | auto (val_fraction of the samples, chosen by a hash of their content)
    weight: float = 1.0  # after dedup and limit: 2 repeats each sample, 0.5 keeps a deterministic half
    limit: int | None = None  # at most this many samples (a deterministic random subset)
    turns: str = "all"  # all | first: a conversation only up to and including its first assistant reply

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"data source {self.path!r}: format={self.format!r}; expected one of {', '.join(FORMATS)}")
        if self.split not in ("train", "val", "auto"):
            raise ValueError(f"data source {self.path!r}: split={self.split!r}; expected train, val or auto")
        if self.weight <= 0:
            raise ValueError(f"data source {self.path!r}: weight must be > 0, got {self.weight}")
        if self.turns not in ("all", "first"):
            raise ValueError(f"data source {self.path!r}: turns={self.turns!r}; expected all (every turn) or first "
                             "(up to and including the first assistant reply)")


@dataclass
class DataConfig:
    sources: list[SourceConfig] = field(default_factory=list)
    max_length: int = 2048  # tokens per sample; text documents are cut into chunks of this size
    overlong: str = "truncate"  # truncate | drop: what happens to a conversation longer than max_length
    last_turn_only: bool = False  # train only on the last assistant turn of each conversation
    dedupe: bool = True
    val_fraction: float = 0.02  # share of the samples of split=auto sources that go to val
    on_bad_line: str = "error"  # error: stop before writing, naming file:line and field | skip: count and go on
    regenerate: bool = False  # replace assistant turns with the target's own replies (self-distillation)
    regen_temperature: float = 0.0  # 0 = greedy
    regen_max_new_tokens: int = 256
    regen_batch_size: int = 8  # our engine: rows decoded together; vLLM: its max_num_seqs
    # ours | vllm (vLLM's CPU or GPU build run offline in its own venv, regen_engines.py) | auto: vLLM when its
    # Python ($MTP_TRAIN_VLLM_PYTHON, else .venv-vllm) is found, imports and runs on the target's device, else ours;
    # with regenerate_server set, neither it nor regen_dtype is read
    regen_engine: str = "auto"
    regen_dtype: str = "auto"  # float32 | bfloat16 | auto: bf16 on a GPU or a CPU with AMX, else fp32
    regen_cache: bool = True  # keep finished replies in $MTP_TRAIN_DATA/regenerated, reused by a run of the same inputs
    regen_chunk: int = 256  # vLLM: prompts sent together, their replies committed to the journal together
    # an OpenAI-compatible server (vLLM, SGLang) that serves the run's target, e.g. http://127.0.0.1:8000/v1: the
    # replies come from it instead of our engine (the regen_* settings below only apply to it)
    regenerate_server: str = ""
    regen_model: str = ""  # the served model's name; "" = the server's first (GET /models)
    regen_concurrency: int = 16  # requests in flight
    regen_timeout: float = 300.0  # seconds per request
    regen_retries: int = 3  # attempts after the first, with exponential backoff (1 s, 2 s, 4 s ...)
    # a target_prompts source: the target writes the user prompts (sampled in batches of regen_batch_size)
    synth_temperature: float = 1.0  # sampling temperature of the prompts (> 0: greedy would write one prompt)
    synth_max_new_tokens: int = 128  # longest prompt; one without its end-of-turn token by then is dropped
    synth_system: str = ""  # the system prompt before the user header; "" = the chat template's default (or none)
    # drop a conversation whose prompt overlaps a prompt of validate.prompts / validate.test_prompts (decontaminate.py)
    decontaminate: bool = False
    overwrite: bool = False  # replace an existing run_dir/data made with another config

    def __post_init__(self) -> None:
        if self.overlong not in ("truncate", "drop"):
            raise ValueError(f"data.overlong={self.overlong!r}; expected truncate or drop")
        if self.on_bad_line not in ("error", "skip"):
            raise ValueError(f"data.on_bad_line={self.on_bad_line!r}; expected error or skip")
        if self.max_length < 2:
            raise ValueError(f"data.max_length must be at least 2, got {self.max_length}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.regenerate_server and not self.regenerate_server.startswith(("http://", "https://")):
            raise ValueError(f"data.regenerate_server={self.regenerate_server!r}: expected an http(s) URL of an "
                             "OpenAI-compatible API, e.g. http://127.0.0.1:8000/v1")
        if self.regen_engine not in REGEN_ENGINES or self.regen_dtype not in REGEN_DTYPES or self.regen_chunk < 1:
            raise ValueError(f"data.regen_engine={self.regen_engine!r} (one of {', '.join(REGEN_ENGINES)}), "
                             f"data.regen_dtype={self.regen_dtype!r} (one of {', '.join(REGEN_DTYPES)}), "
                             f"data.regen_chunk={self.regen_chunk} (>= 1)")
        if self.regen_concurrency < 1 or self.regen_retries < 0 or self.regen_timeout <= 0:
            raise ValueError(f"data.regen_concurrency={self.regen_concurrency} (>= 1), data.regen_retries="
                             f"{self.regen_retries} (>= 0), data.regen_timeout={self.regen_timeout} (> 0)")
        if self.synth_temperature <= 0 or self.synth_max_new_tokens < 1:
            raise ValueError(f"data.synth_temperature={self.synth_temperature} (> 0: greedy writes one prompt over and "
                             f"over), data.synth_max_new_tokens={self.synth_max_new_tokens} (>= 1)")
