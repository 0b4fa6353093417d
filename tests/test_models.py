"""The LLaMA model: shapes, stage slicing, and logits equal to Hugging Face's on the same weights."""

import pytest
import torch

from agoq.models import PRESETS, Llama, LlamaConfig, get_config

SMALL = LlamaConfig(vocab_size=97, hidden=64, n_layers=3, n_heads=4, n_kv_heads=2, intermediate=160, max_seq_len=64)


def test_presets_have_published_parameter_counts():
    # Published sizes (billions): the architecture numbers must reproduce them.
    expected = {"llama2-7b": 6.74, "llama3-8b": 8.03, "llama2-13b": 13.02, "codellama-34b": 33.74, "llama3-70b": 70.55, "llama3.2-1b": 1.24}
    for name, billions in expected.items():
        assert PRESETS[name].num_parameters() / 1e9 == pytest.approx(billions, abs=0.01), name


def test_stages_compose_to_the_full_model():
    torch.manual_seed(0)
    full = Llama(SMALL)
    stages = [Llama(SMALL, layers=range(0, 1)), Llama(SMALL, layers=range(1, 3))]
    state = full.state_dict()
    for s in stages:
        s.load_state_dict({k: v for k, v in state.items() if k in s.state_dict()})
    assert set(stages[0].state_dict()) | set(stages[1].state_dict()) == set(state)
    tokens = torch.randint(0, SMALL.vocab_size, (2, 17))
    torch.testing.assert_close(stages[1](stages[0](tokens)), full(tokens), rtol=0, atol=0)


def test_bad_configs_name_the_value():
    with pytest.raises(ValueError, match="n_kv_heads=3"):
        LlamaConfig(hidden=64, n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="unknown model preset 'llama9'"):
        get_config("llama9")
    with pytest.raises(ValueError, match="max_seq_len"):
        Llama(SMALL)(torch.zeros(1, 65, dtype=torch.long))


@pytest.mark.parametrize(
    "cfg",
    [
        SMALL,  # GQA, untied head
        LlamaConfig(
            vocab_size=101, hidden=96, n_layers=2, n_heads=6, n_kv_heads=6, intermediate=200, max_seq_len=64, rope_theta=50000.0, norm_eps=1e-6
        ),
        LlamaConfig(
            vocab_size=89, hidden=64, n_layers=2, n_heads=8, n_kv_heads=1, intermediate=128, max_seq_len=64, tie_embeddings=True, rope_theta=500000.0
        ),
    ],
)
def test_logits_equal_hugging_face_on_the_same_weights(cfg, tmp_path):
    transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    from agoq.models.hf import config_from_hf, from_hf_state_dict, hf_config, load_safetensors, save_safetensors, to_hf_state_dict

    torch.manual_seed(1)
    hf = transformers.LlamaForCausalLM(hf_config(cfg)).float().eval()
    assert config_from_hf(hf.config) == cfg
    ours = Llama(cfg)
    ours.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg))
    tokens = torch.randint(0, cfg.vocab_size, (2, 23))
    with torch.no_grad():
        expected = hf(tokens).logits
        got = ours(tokens)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # And back: the round trip reproduces Hugging Face's tensors exactly, through safetensors too.
    back = to_hf_state_dict(ours.state_dict(), cfg)
    hf_state = {k: v for k, v in hf.state_dict().items() if not k.endswith("inv_freq")}
    if cfg.tie_embeddings:
        hf_state.pop("lm_head.weight", None)
    assert set(back) == set(hf_state)
    for k in back:
        assert torch.equal(back[k], hf_state[k]), k
    save_safetensors(ours.state_dict(), cfg, tmp_path / "model.safetensors")
    loaded = load_safetensors(tmp_path / "model.safetensors", cfg)
    for k, v in ours.state_dict().items():
        assert torch.equal(loaded[k], v), k
