import pytest
from transformers import DeepseekV2Config, LlamaConfig, Qwen2Config

from mtp_train.model.target import TargetArch


def test_llama_70b_numbers_from_config():
    cfg = LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                      num_key_value_heads=8, vocab_size=128256, rms_norm_eps=1e-5, max_position_embeddings=131072,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192})
    arch = TargetArch.from_dict(cfg.to_dict())
    assert (arch.model_type, arch.hidden_size, arch.num_hidden_layers) == ("llama", 8192, 80)
    assert (arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim) == (64, 8, 128)
    assert (arch.intermediate_size, arch.vocab_size) == (28672, 128256)
    assert arch.rope_theta == 500000.0 and arch.rope_parameters["rope_type"] == "llama3"
    assert arch.tie_word_embeddings is False and arch.mla is None


def test_legacy_rope_theta_field_and_explicit_head_dim():
    arch = TargetArch.from_dict({"model_type": "qwen3", "hidden_size": 1024, "num_hidden_layers": 28,
                                 "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                                 "intermediate_size": 3072, "vocab_size": 151936, "rope_theta": 1000000.0,
                                 "tie_word_embeddings": True})
    assert arch.head_dim == 128 and arch.rope_theta == 1e6 and arch.tie_word_embeddings


def test_qwen2_gqa():
    cfg = Qwen2Config(hidden_size=896, num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864,
                      num_hidden_layers=24, vocab_size=151936)
    arch = TargetArch.from_dict(cfg.to_dict())
    assert (arch.head_dim, arch.num_key_value_heads) == (64, 2)


def test_deepseek_v2_lite_mla_fields():
    cfg = DeepseekV2Config(hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
                           num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
                           kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128,
                           qk_nope_head_dim=128, vocab_size=102400)
    arch = TargetArch.from_dict(cfg.to_dict())
    assert arch.mla == {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
                        "q_lora_rank": 0}
    assert arch.head_dim == 192 and arch.intermediate_size == 10944


def test_unsupported_and_incomplete_configs_are_named():
    with pytest.raises(ValueError, match=r"x/config.json: model_type 'gpt2' is not supported"):
        TargetArch.from_dict({"model_type": "gpt2"}, source="x/config.json")
    with pytest.raises(ValueError, match=r"missing field 'vocab_size'"):
        TargetArch.from_dict({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
                              "num_hidden_layers": 2, "intermediate_size": 128})


def test_from_pretrained_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="target directory not found"):
        TargetArch.from_pretrained(tmp_path / "absent")
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        TargetArch.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        TargetArch.from_pretrained(tmp_path)
