"""The shipped config files load; the tiny one is exactly the embedded default."""

from pathlib import Path

import pytest

from agoq.launch.config import ConfigError, TrainConfig, load_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_tiny_config_file_is_the_embedded_default():
    assert load_config(CONFIGS / "tiny_cpu.toml").to_dict() == load_config(None).to_dict() == TrainConfig().to_dict()


@pytest.mark.parametrize("name", ["llama3-8b_gpu.toml", "llama2-13b_tp8_gpu.toml"])
def test_gpu_example_is_valid_apart_from_its_data_paths(name):
    with pytest.raises(ConfigError, match="data.corpus='/data/my_corpus' does not exist"):
        load_config(CONFIGS / name)
    cfg = load_config(CONFIGS / name, ["--data.corpus=kjv", "--data.tokenizer=none"])
    # Every key the file sets reaches the config with its value (the two overridden above aside).
    import tomllib

    written = tomllib.loads((CONFIGS / name).read_text())
    assert written, "the GPU example sets nothing"
    for section, values in written.items():
        for key, value in values.items():
            if (section, key) in (("data", "corpus"), ("data", "tokenizer")):
                continue
            got = cfg.model.overrides.get(key) if section == "model" and key != "preset" else getattr(getattr(cfg, section), key)
            assert got == value, f"{section}.{key} = {value!r} in the file, {got!r} in the config"


def test_overrides_beat_the_file_and_bad_files_are_named(tmp_path):
    cfg = load_config(CONFIGS / "tiny_cpu.toml", ["--train.steps=7"])
    assert cfg.train.steps == 7
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nsteps = \n")
    with pytest.raises(ConfigError, match="bad.toml is not valid TOML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
