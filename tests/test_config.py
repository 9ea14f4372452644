"""Config schema: every bad value raises a ConfigError that names the key and the allowed range."""

import json
from pathlib import Path

import pytest
import torch

import commhooks
from commhooks.config import ConfigError, QSRConfig, from_dict, load_config, to_dict

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "key, value, pattern",
    [
        ("alpha", -0.1, r"qsr\.alpha must be >= 0"),
        ("alpha", float("nan"), r"qsr\.alpha must be a finite number"),
        ("alpha", "0.1", r"qsr\.alpha must be a finite number"),
        ("h_base", 0, r"qsr\.h_base must be >= 1"),
        ("h_base", 2.5, r"qsr\.h_base must be an integer"),
        ("h_base", True, r"qsr\.h_base must be an integer"),
        ("init_h", 0, r"qsr\.init_h must be >= 1"),
        ("power", 0, r"qsr\.power must be > 0"),
        ("power", -2, r"qsr\.power must be > 0"),
        ("warmup_steps", -1, r"qsr\.warmup_steps must be >= 0"),
        ("total_steps", 0, r"qsr\.total_steps must be >= 1"),
        ("average_buffers", 1, r"qsr\.average_buffers must be true or false"),
        ("average_optimizer_state", "yes", r"qsr\.average_optimizer_state must be true or false"),
    ],
)
def test_bad_qsr_value_names_the_key(key, value, pattern):
    with pytest.raises(ConfigError, match=pattern):
        from_dict({"type": "qsr", key: value})
    with pytest.raises(ConfigError, match=pattern):
        commhooks.QSRState(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), **{key: value})


def test_unknown_keys_are_listed_with_the_allowed_ones():
    with pytest.raises(ConfigError, match=r"unknown key\(s\) 'h_bsae'.*allowed: .*alpha, h_base"):
        from_dict({"type": "qsr", "h_bsae": 4})
    with pytest.raises(ConfigError, match=r"QSRState: unknown key\(s\) 'lr'"):
        commhooks.QSRState(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), lr=0.1)


def test_type_is_required_and_checked():
    with pytest.raises(ConfigError, match=r"config\.type is required"):
        from_dict({"alpha": 0.1})
    with pytest.raises(ConfigError, match=r"config\.type must be one of 'none', 'qsr'"):
        from_dict({"type": "powersgd"})
    with pytest.raises(ConfigError, match=r"type is 'qsr' but a 'ab' config was expected"):
        from_dict({"type": "qsr"}, kind="ab")
    with pytest.raises(ConfigError, match=r"must be a JSON object"):
        from_dict([1, 2])
    assert from_dict({"type": "none"}) is None


def test_json_files_and_deepspeed_section(tmp_path):
    plain = tmp_path / "q.json"
    plain.write_text(json.dumps({"type": "qsr", "alpha": 0.2, "h_base": 2}))
    assert load_config(plain) == QSRConfig(alpha=0.2, h_base=2)
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 8, "comm_hook": {"type": "qsr", "h_base": 3, "oops": 1}}))
    with pytest.raises(ConfigError, match=r"ds\.json\.comm_hook: unknown key\(s\) 'oops'"):
        load_config(ds)
    # a bad value in a DeepSpeed config is named as the user wrote it (comm_hook.payload, not qsr.payload)
    ds.write_text(json.dumps({"train_batch_size": 8, "comm_hook": {"type": "qsr", "payload": "int3"}}))
    with pytest.raises(ConfigError, match=r"^comm_hook\.payload must be one of 'fp32', 'bf16', 'int8', 'int4', 'int2', "
                                          r"'topk', got 'int3'"):
        load_config(ds)
    with pytest.raises(ConfigError, match=r"^qsr\.payload must be one of"):  # a plain hook config: the type
        load_config({"type": "qsr", "payload": "int3"})
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(ConfigError, match=r"broken\.json' is not valid JSON"):
        load_config(broken)
    with pytest.raises(ConfigError, match=r"does not exist"):
        load_config(tmp_path / "missing.json")


def test_round_trip_and_shipped_configs():
    conf = QSRConfig(alpha=0.1, h_base=4, warmup_steps=50)
    assert load_config(to_dict(conf)) == conf
    shipped = sorted((REPO / "configs").glob("*.json"))
    assert shipped, "configs/ ships no JSON files"
    for path in shipped:
        load_config(path)  # every shipped file is valid
