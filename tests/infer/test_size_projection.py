"""infer.size_projection: the engine's costs at real model sizes from random weights, rehearsed at tiny scale."""

import json

import pytest
import torch

from infer import results, size_projection
from tests.conftest import test_device as device_under_test

# parameters of the released models (their model cards: 1.54B, 3.21B, 8.03B)
RELEASED = {"qwen2.5-1.5b": 1_543_714_304, "llama-3.2-3b": 3_212_749_824, "llama-3.1-8b": 8_030_261_248}


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_each_shape_has_the_released_models_parameter_count(name):
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(size_projection.SHAPES[name])
    with torch.device("meta"):  # shapes only, no memory
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields))
    assert sum(p.numel() for p in model.parameters()) == RELEASED[name]


def test_tiny_keeps_the_kind_and_the_mlp_ratio():
    for shape in size_projection.SHAPES.values():
        small = size_projection.tiny(shape)
        assert small["model_type"] == shape["model_type"]
        assert small.get("rope_scaling") == shape.get("rope_scaling")
        assert small["hidden_size"] == 64 and small["num_hidden_layers"] == 2
        assert small["intermediate_size"] / 64 == pytest.approx(shape["intermediate_size"] / shape["hidden_size"],
                                                                rel=0.1)


def test_projection_is_tau_tokens_per_round_against_ar():
    assert size_projection.projection(ar_s=0.010, round_s=0.020, tau=3.0) == pytest.approx(1.5)


def test_tiny_run_measures_projects_and_renders(tmp_path, fake_capture):
    """The whole run at tiny scale on the test device (static shapes captured by the CPU stand-in, or by CUDA):
    every row count and depth measured, no capture falling back, the projection consistent with its inputs, and
    the results page renders the report as a projection."""
    out, md = tmp_path / "size-projection.json", tmp_path / "size-projection.md"
    rc = size_projection.main(["--scale", "tiny", "--sizes", "llama-3.1-8b", "--device", str(device_under_test()),
                               "--dtype", "float32", "--context", "32", "--new-tokens", "8", "--repeats", "1",
                               "--json", str(out), "--markdown", str(md)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["kind"] == "size-projection" and not report["failed"]
    s = report["sizes"]["llama-3.1-8b"]
    assert [int(n) for n in s["verify_seconds"]] == list(size_projection.ROWS)
    assert all(v > 0 for v in s["verify_seconds"].values())
    assert [int(d) for d in s["draft_seconds_by_depth"]] == list(size_projection.DEPTHS)
    assert all(v > 0 for v in s["draft_seconds_by_depth"].values())
    assert s["graph_captures"] > 0 and s["graph_fallbacks"] == 0
    assert 2 <= s["auto_tree_size"] <= 64
    full = s["round_seconds_by_depth"][str(max(size_projection.DEPTHS))]
    assert s["break_even_tau"] == pytest.approx(full["round"] / s["ar_seconds_per_token"])
    ours, published = s["projected_speedup"]
    assert ours["tau"] == size_projection.ACCEPTED[0]["tau"]
    assert ours["speedup"] == pytest.approx(ours["tau"] / s["break_even_tau"])
    assert published["tau"] == size_projection.PUBLISHED["llama-3.1-8b"]["tau"]
    assert "PROJECTION" in md.read_text() and "| llama-3.1-8b |" in md.read_text()
    page = results.render([str(out)])
    assert page.startswith("## Projection") and "break-even tau" in page
