"""The prepare stage's settings (`data.*`): the sources a recipe reads and how they become samples. Plain dataclasses,
no torch: `mtp_train.config` composes them into the run config."""

from __future__ import annotations

from dataclasses import dataclass, field


FORMATS = ("auto", "sharegpt", "openai", "text", "hf_disk", "stdlib", "stdlib_chat")  # a source's format
PROMPT_SETS = ("recipe", "mt-bench")  # built-in held-out prompt sets (prompt_sets.py); validate.prompts names them


@dataclass
class SourceConfig:
    path: str = "???"  # a file or directory; for stdlib / stdlib_chat, a corpus split (head-train, validation)
    format: str = "auto"  # auto | sharegpt | openai | text | hf_disk | stdlib | stdlib_chat
    split: str = "auto"  # train | val | auto (val_fraction of the samples, chosen by a hash of their content)
    weight: float = 1.0  # after dedup and limit: 2 repeats each sample, 0.5 keeps a deterministic half
    limit: int | None = None  # at most this many samples (a deterministic random subset)

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"data source {self.path!r}: format={self.format!r}; expected one of {', '.join(FORMATS)}")
        if self.split not in ("train", "val", "auto"):
            raise ValueError(f"data source {self.path!r}: split={self.split!r}; expected train, val or auto")
        if self.weight <= 0:
            raise ValueError(f"data source {self.path!r}: weight must be > 0, got {self.weight}")


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
    regen_batch_size: int = 8
    # an OpenAI-compatible server (vLLM, SGLang) that serves the run's target, e.g. http://127.0.0.1:8000/v1: the
    # replies come from it instead of our engine (the regen_* settings below only apply to it)
    regenerate_server: str = ""
    regen_model: str = ""  # the served model's name; "" = the server's first (GET /models)
    regen_concurrency: int = 16  # requests in flight
    regen_timeout: float = 300.0  # seconds per request
    regen_retries: int = 3  # attempts after the first, with exponential backoff (1 s, 2 s, 4 s ...)
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
        if self.regen_concurrency < 1 or self.regen_retries < 0 or self.regen_timeout <= 0:
            raise ValueError(f"data.regen_concurrency={self.regen_concurrency} (>= 1), data.regen_retries="
                             f"{self.regen_retries} (>= 0), data.regen_timeout={self.regen_timeout} (> 0)")
