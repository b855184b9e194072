"""The speculators P-EAGLE export of a real tiny run: every config field, every weight key, shape and
dtype, the Vd == V case, atomic replacement, and a reload that reproduces the trained model's outputs in bf16.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from peagle_pipeline.cache.reader import open_cache
from peagle_pipeline.cli import main
from peagle_pipeline.config import SERVING_DEPTHS, TrainConfig, resolve
from peagle_pipeline.core import cod
from peagle_pipeline.core.mask import dense_mask
from peagle_pipeline.errors import BadInput, OutputExists, ResumeMismatch
from peagle_pipeline.stages.checkpoint import CheckpointManager
from peagle_pipeline.stages.draft_spec import DraftSpec
from peagle_pipeline.stages.export import stage as export
from peagle_pipeline.stages.export.marker import MARKER_FILE, trained_depths
from peagle_pipeline.stages.export.speculators_format import load_export, serving_depths
from peagle_pipeline.stages.train import draft, trainer
from peagle_pipeline.stages.train import stage as train
from peagle_pipeline.stages.train.metrics import read_metrics

pytestmark = pytest.mark.slow

H, V, VD, N_AUX, LAYERS, K = 64, 512, 300, 2, 2, 4
FLAGS = {
    "depths": K,
    "tokens_per_step": 256,
    "steps": 3,
    "eval_every": 3,
    "save_every": 3,
    "eval_samples": 4,
    "precision": "fp32",
    "warmup": 1,
    "lr": 2e-3,
    "num_workers": 0,
    "draft_layers": LAYERS,
    "export": False,
}


def _cfg(cache: Path, out: Path, **extra) -> TrainConfig:
    return resolve(TrainConfig, None, {"cache": str(cache), "output": str(out), **FLAGS, **extra})


@pytest.fixture(scope="module")
def run_dir(tiny_cache: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export") / "run"
    train.run(_cfg(tiny_cache, out, draft_vocab_size=VD))
    return out


def test_config_has_every_field(run_dir: Path, tiny_cache: Path, tmp_path: Path) -> None:
    path = export.export_run(run_dir, tmp_path / "draft", checkpoint="latest")
    cfg = json.loads((path / "config.json").read_text())
    meta = open_cache(str(tiny_cache)).meta
    assert cfg["speculators_model_type"] == "peagle" and "model_type" not in cfg
    spec = cfg["speculators_config"]
    assert spec["algorithm"] == "peagle" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"] == [
        {"proposal_type": "greedy", "speculative_tokens": K, "verifier_accept_k": 1, "accept_tolerance": 0.0}
    ]
    assert spec["verifier"] == {
        "name_or_path": meta.target_name_or_path,
        "architectures": list(meta.target_architectures),
    }
    layer = cfg["transformer_layer_config"]
    assert (
        layer["model_type"] == "llama" and layer["num_hidden_layers"] == LAYERS and layer["vocab_size"] == V
    )
    assert layer["num_aux_hidden_states"] == N_AUX and layer["hidden_size"] == H and layer["head_dim"] == 32
    assert layer["num_attention_heads"] == 2 and layer["num_key_value_heads"] == 1
    assert layer["rope_parameters"]["rope_theta"] == 10000.0
    assert cfg["draft_vocab_size"] == VD and cfg["target_hidden_size"] == H
    assert cfg["eagle_aux_hidden_state_layer_ids"] == list(meta.aux_layer_ids)
    assert cfg["mask_token_id"] == 400  # first unused embedding row of the tiny tokenizer (400 of 512)
    assert cfg["norm_before_residual"] is False and cfg["norm_before_fc"] is False
    assert "fc_norm" not in cfg and "norm_output" not in cfg
    assert not list(tmp_path.glob(".draft*"))  # no temporary directory left behind


LOAD_AS_VLLM_DOES = """
import json, sys
from transformers import PretrainedConfig
layer = json.load(open(sys.argv[1]))["transformer_layer_config"]
config = PretrainedConfig()
for key, value in layer.items():  # vLLM's SpeculatorsConfig sets each layer setting on a transformers config
    if key != "model_type":
        setattr(config, key, value)
print(config.dtype)
"""


def test_loading_the_export_config_prints_no_transformers_warning(run_dir: Path, tmp_path: Path) -> None:
    """The dtype is written as `dtype` (transformers >= 4.56): `torch_dtype` made every load of the export
    print transformers' deprecation warning (vLLM sets each layer setting on a transformers config)."""
    path = export.export_run(run_dir, tmp_path / "draft", checkpoint="latest")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["dtype"] == cfg["transformer_layer_config"]["dtype"] == "bfloat16"
    assert "torch_dtype" not in cfg and "torch_dtype" not in cfg["transformer_layer_config"]
    cmd = [sys.executable, "-c", LOAD_AS_VLLM_DOES, str(path / "config.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() in ("bfloat16", "torch.bfloat16"), proc.stderr
    assert "deprecated" not in proc.stderr, proc.stderr


def test_weights_keys_shapes_dtypes(run_dir: Path, tmp_path: Path) -> None:
    path = export.export_run(run_dir, tmp_path / "draft", checkpoint="best")
    w = load_file(str(path / "model.safetensors"))
    expect = {
        "embed_tokens.weight": (V, H),
        "fc.weight": (H, N_AUX * H),
        "layers.0.hidden_norm.weight": (H,),
        "norm.weight": (H,),
        "lm_head.weight": (VD, H),
        "mask_hidden": (1, 1, N_AUX * H),
        "d2t": (VD,),
        "t2d": (V,),
    }
    for i in range(LAYERS):
        inp = 2 * H if i == 0 else H
        expect.update(
            {
                f"layers.{i}.input_layernorm.weight": (H,),
                f"layers.{i}.post_attention_layernorm.weight": (H,),
                f"layers.{i}.self_attn.q_proj.weight": (64, inp),
                f"layers.{i}.self_attn.k_proj.weight": (32, inp),
                f"layers.{i}.self_attn.v_proj.weight": (32, inp),
                f"layers.{i}.self_attn.o_proj.weight": (H, 64),
                f"layers.{i}.mlp.gate_proj.weight": (128, H),
                f"layers.{i}.mlp.up_proj.weight": (128, H),
                f"layers.{i}.mlp.down_proj.weight": (H, 128),
            }
        )
    assert {k: tuple(v.shape) for k, v in w.items()} == expect
    assert w["d2t"].dtype == torch.int64 and w["t2d"].dtype == torch.bool
    assert all(v.dtype == torch.bfloat16 for k, v in w.items() if k not in ("d2t", "t2d"))
    assert int(w["t2d"].sum()) == VD
    ids = torch.arange(VD) + w["d2t"]  # draft id -> target id, ascending and inside t2d
    assert bool((ids[1:] > ids[:-1]).all()) and bool(w["t2d"][ids].all())


def test_full_vocabulary_has_no_mapping(tiny_cache: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    train.run(_cfg(tiny_cache, run, steps=1, eval_samples=0))  # default draft_vocab_size is capped at V
    w = load_file(str(export.export_run(run, tmp_path / "draft", checkpoint="latest") / "model.safetensors"))
    assert "d2t" not in w and "t2d" not in w and w["lm_head.weight"].shape == (V, H)


def test_reload_reproduces_the_trained_model(run_dir: Path, tiny_cache: Path, tmp_path: Path) -> None:
    path = export.export_run(run_dir, tmp_path / "draft", checkpoint="latest")
    trained, _, _ = draft.build_draft(
        open_cache(str(tiny_cache)), _cfg(tiny_cache, run_dir, draft_vocab_size=VD)
    )
    ckpt = CheckpointManager(run_dir, 1).load_latest(with_optimizer=False)
    trained.load_state_dict(ckpt.model)
    trained = trained.to(torch.bfloat16).eval()
    loaded = load_export(path)
    assert next(loaded.parameters()).dtype == torch.bfloat16

    g = torch.Generator().manual_seed(0)
    L = 40
    weight = torch.ones(L, dtype=torch.bool)
    layout = cod.build_layout([25, 15], weight, cod.CODConfig(depths=K), None, full=True)
    tokens = torch.randint(0, 400, (L,), generator=g)
    aux = torch.randn(L, N_AUX * H, generator=g).to(torch.bfloat16)
    mask = dense_mask(layout)
    with torch.no_grad():
        a = trained.forward_layout(layout, tokens, aux, mask)
        b = loaded.forward_layout(layout, tokens, aux, mask)
        assert torch.equal(a, b)
        assert torch.equal(trained.logits(a), loaded.logits(b))
    assert torch.equal(trained.d2t, loaded.d2t) and torch.equal(trained.t2d, loaded.t2d)


def test_an_eagle3_run_exports_the_eagle3_format(tiny_cache: Path, tmp_path: Path) -> None:
    """`train --method eagle3`: the speculators eagle3 config (the P-EAGLE fields but the mask token), no
    `mask_hidden`, a reload that reproduces the trained steps; resuming it as another method is refused."""
    run = tmp_path / "run"
    train.run(_cfg(tiny_cache, run, method="eagle3", steps=2, eval_every=2, draft_vocab_size=VD))
    held_out = [r for r in read_metrics(run) if r["kind"] == "eval"][-1]  # the held-out figures, as P-EAGLE's
    assert held_out["acceptance"] >= 1.0 and len(held_out["agreement"]) == K and held_out["acceptance_walk"]
    assert (run / "plots" / "acceptance.png").is_file() and json.loads((run / "draft.json").read_text())[
        "method"
    ] == "eagle3"
    path = export.export_run(run, tmp_path / "draft", checkpoint="latest")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["speculators_config"]["algorithm"] == "eagle3"
    assert "mask_token_id" not in cfg and cfg["norm_before_residual"] is False
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == K
    layer = cfg["transformer_layer_config"]
    assert layer["num_hidden_layers"] == LAYERS and layer["num_aux_hidden_states"] == N_AUX
    w = load_file(str(path / "model.safetensors"))
    assert "mask_hidden" not in w and {"fc.weight", "layers.0.hidden_norm.weight", "d2t", "t2d"} <= set(w)
    trained, _, _ = draft.build_draft(
        open_cache(str(tiny_cache)), _cfg(tiny_cache, run, method="eagle3", draft_vocab_size=VD)
    )
    trained.load_state_dict(CheckpointManager(run, 1).load_latest(with_optimizer=False).model)
    loaded = load_export(path)
    assert type(loaded).__name__ == "Eagle3Draft"
    layout = cod.build_layout(
        [25, 15], torch.ones(40, dtype=torch.bool), cod.CODConfig(depths=K), None, full=True
    )
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 400, (40,), generator=g)
    aux = torch.randn(40, N_AUX * H, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        a = trained.to(torch.bfloat16).eval().forward_layout(layout, tokens, aux, greedy=True)
        assert torch.equal(a, loaded.forward_layout(layout, tokens, aux, greedy=True))
    with pytest.raises(ResumeMismatch, match="method"):
        train.run(_cfg(tiny_cache, run, method="peagle", steps=3, eval_samples=0, resume=True))


def test_export_refuses_bad_requests(run_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="no complete checkpoint step-99"):
        export.export_run(run_dir, tmp_path / "d", checkpoint="step-99")
    with pytest.raises(BadInput, match="latest, best or step-N"):
        export.export_run(run_dir, tmp_path / "d", checkpoint="newest")
    with pytest.raises(BadInput, match="not a training run"):
        export.export_run(tmp_path, tmp_path / "d")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("x")
    with pytest.raises(OutputExists):
        export.export_run(run_dir, foreign)
    assert (foreign / "keep.txt").read_text() == "x"


def test_export_cli_replaces_a_previous_export(run_dir: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "draft"
    assert main(["export", str(run_dir), "--output", str(out), "--checkpoint", "step-3"]) == 0
    assert main(["export", str(run_dir), "--output", str(out)]) == 0  # an export there is ours: replaced
    assert f"exported to {out}" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == [
        MARKER_FILE,
        "README.md",
        "config.json",
        "model.safetensors",
    ]
    marker = json.loads((out / MARKER_FILE).read_text())
    assert marker["run"] == str(run_dir.resolve()) and marker["checkpoint"] == "step-00000003"
    assert main(["export", str(tmp_path / "nope"), "--output", str(tmp_path / "x")]) == 2
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary or old folder left


def test_export_records_the_served_k_apart_from_the_trained_k(run_dir: Path, tmp_path: Path, capsys) -> None:
    """Train deeper than you serve: speculative_tokens is the served K, at most the trained one."""

    def served(path: Path) -> int:
        cfg = json.loads((path / "config.json").read_text())
        return cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"]

    assert serving_depths(8) == SERVING_DEPTHS == 4 and serving_depths(3) == 3
    out = tmp_path / "draft"
    assert main(["export", str(run_dir), "--output", str(out), "--speculative-tokens", "2"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert served(out) == 2 and trained_depths(out, cfg) == K
    assert json.loads((out / MARKER_FILE).read_text())["trained_depths"] == K
    assert main(["export", str(run_dir), "--output", str(out)]) == 0
    assert served(out) == min(SERVING_DEPTHS, K)
    capsys.readouterr()
    assert main(["export", str(run_dir), "--output", str(out), "--speculative-tokens", str(K + 1)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error: --speculative-tokens {K + 1} exceeds the {K} depths the draft was trained for: give at most {K}, "
        f"or train with --depths {K + 1} or more"
    ]
    assert served(out) == min(SERVING_DEPTHS, K)  # the previous export is untouched
    with pytest.raises(BadInput, match="must be positive"):
        export.export_run(run_dir, tmp_path / "d", speculative_tokens=0)


def test_non_finite_weights_are_never_exported_or_saved(
    run_dir: Path, tiny_cache: Path, tmp_path: Path
) -> None:
    """A diverged draft (the old `--lr inf` run exported NaN embed_tokens with exit 0) stops with exit 8."""
    from peagle_pipeline.errors import NumericalFault
    from peagle_pipeline.stages.train.distributed import Dist

    spec = DraftSpec.load(run_dir)
    state = CheckpointManager(run_dir, keep=1).load_latest(with_optimizer=False).model
    state = {k: v.clone() for k, v in state.items()}
    state["embed_tokens.weight"][3, 1] = float("nan")
    out = tmp_path / "exp"
    with pytest.raises(NumericalFault, match="embed_tokens.weight hold non-finite values"):
        export.write_export(out, spec, state)
    assert not out.exists() and list(tmp_path.iterdir()) == []

    run_trainer = trainer.Trainer(_cfg(tiny_cache, tmp_path / "run"), Dist())
    with torch.no_grad():
        run_trainer.model.fc.weight[0, 0] = float("inf")
    with pytest.raises(NumericalFault, match=r"weights became non-finite by step 0 \(fc.weight\)"):
        run_trainer.save()
    assert not (tmp_path / "run" / "checkpoints").exists()


# ---- an export folder is ours only if it holds exactly what an export writes --------------
def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("extra", ["README.md", "tokenizer.json", "sub/notes.txt"])
def test_export_refuses_a_folder_with_files_it_did_not_write(
    run_dir: Path, tmp_path: Path, capsys, extra: str
) -> None:
    out = tmp_path / "draft"
    export.export_run(run_dir, out, checkpoint="latest")
    (out / extra).parent.mkdir(exist_ok=True)
    (out / extra).write_text("the user's file\n")
    before = _tree(out)
    assert main(["export", str(run_dir), "--output", str(out)]) == 6
    assert main(["export", str(run_dir), "--output", str(out), "--force"]) == 6  # --force never deletes them
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("error: ") for line in err), err
    assert f"{out} holds files that are not part of a draft export ({extra.split('/')[0]})" in err[0]
    assert _tree(out) == before


def test_export_refuses_a_hugging_face_model_folder(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "model"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (out / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(OutputExists, match="not a draft export"):
        export.export_run(run_dir, out, force=True)
    assert (out / "model.safetensors").read_bytes() == b"weights"


def test_export_onto_another_runs_export_needs_force(run_dir: Path, tmp_path: Path, capsys) -> None:
    other = tmp_path / "other-run"  # another run: a copy with its own start (run.json) and path
    shutil.copytree(run_dir, other)
    facts = json.loads((other / "run.json").read_text())
    facts["starts"][0]["time"] += 1.0
    (other / "run.json").write_text(json.dumps(facts))
    out = tmp_path / "draft"
    export.export_run(other, out, checkpoint="latest")
    before = _tree(out)
    assert main(["export", str(run_dir), "--output", str(out)]) == 6
    line = capsys.readouterr().err.strip()
    assert f"{out} holds the export of another run ({other.resolve()}" in line and "--force" in line
    assert _tree(out) == before
    assert main(["export", str(run_dir), "--output", str(out), "--force", "--checkpoint", "latest"]) == 0
    assert json.loads((out / MARKER_FILE).read_text())["run"] == str(run_dir.resolve())
    assert _tree(out) != before
    export.export_run(run_dir, out, checkpoint="latest")  # now ours: replaced without --force


def test_legacy_export_without_marker_needs_force(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "draft"
    export.export_run(run_dir, out, checkpoint="latest")
    (out / MARKER_FILE).unlink()  # as written before the marker existed
    with pytest.raises(OutputExists, match="export of unknown origin"):
        export.export_run(run_dir, out)
    assert export.export_run(run_dir, out, force=True) == out
    assert (out / MARKER_FILE).is_file()


def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mode & 0o777 for p in root.rglob("*") if p.is_file()}


def test_exported_and_checkpoint_files_follow_the_umask(run_dir: Path, tmp_path: Path) -> None:
    """Model.safetensors was written 0600, so a vLLM running as another user could not read it."""
    import os

    old = os.umask(0o027)
    try:
        path = export.export_run(run_dir, tmp_path / "draft", checkpoint="latest")
    finally:
        os.umask(old)
    assert _modes(path) == {
        "config.json": 0o640,
        "model.safetensors": 0o640,
        MARKER_FILE: 0o640,
        "README.md": 0o640,
    }
    assert (path.stat().st_mode & 0o777) == 0o750  # the directory too (it starts as a temporary one)
    ckpt = _modes(run_dir / "checkpoints")
    assert ckpt and set(ckpt.values()) == {0o666 & ~old}, ckpt


def _front_matter(card: str) -> dict:
    import yaml

    assert card.startswith("---\n")
    return yaml.safe_load(card[4 : card.index("\n---\n", 4)])


def test_export_writes_a_model_card(run_dir: Path, tiny_cache: Path, tmp_path: Path) -> None:
    from peagle_pipeline.stages.export import card
    from peagle_pipeline.stages.train import metrics

    out = export.export_run(run_dir, tmp_path / "draft")
    text = (out / "README.md").read_text()
    meta = _front_matter(text)
    assert meta["library_name"] == "vllm" and {"speculative-decoding", "p-eagle"} <= set(meta["tags"])
    assert "base_model" not in meta and "# base_model: the target's model hub id" in text  # a local target
    assert "license" not in meta  # the tiny target's files state none
    cache = open_cache(str(tiny_cache))
    samples, tokens = len(cache.samples), int(cache.samples["length"].sum())
    assert f"| training | {samples:,} | {tokens:,} |" in text and "from the data (off-policy)" in text
    assert (
        "`conv.jsonl` (" in text and "`{}`" not in text
    )  # sources by file name; no template variables: none
    assert (
        f"| K trained / served | {K} / {K} |" in text
        and f"| draft vocabulary | {VD} of the target's {V} " in text
    )
    assert (
        "| optimizer steps | 3 of 3 |" in text
        and "| global batch | 256 tokens (tokens_per_step 256 x 1" in text
    )
    final = [r for r in metrics.read_metrics(run_dir) if r["kind"] == "eval"][-1]
    assert f"On held-out samples at step 3: acceptance length {final['acceptance']:.3f}" in text
    assert '"method": "eagle3", "parallel_drafting": true, "num_speculative_tokens": 4}' in text
    assert "hf upload YOUR-NAMESPACE/" in text and "--exclude .peagle-export.json" in text

    assert card.refresh_measured(out, "| mt-bench | 1.5 |") and card.refresh_measured(
        out, "| mt-bench | 1.6 |"
    )
    again = (out / "README.md").read_text()
    assert "| mt-bench | 1.6 |" in again and "1.5 |" not in again and again.count(card.MEASURED_BEGIN) == 1
    assert _front_matter(again) == meta
    export.export_run(run_dir, out)  # a new export: a new card, not yet measured
    assert "| mt-bench |" not in (out / "README.md").read_text()
    (out / "README.md").write_text("my own notes\n")  # a README of the user's own is never changed
    assert not card.refresh_measured(out, "| x |") and (out / "README.md").read_text() == "my own notes\n"


def test_card_names_the_hub_model_its_license_and_on_policy_data(tmp_path: Path) -> None:
    from peagle_pipeline.data.onpolicy_files import META_FILE as GENERATED
    from peagle_pipeline.stages.export.card_facts import hub_id, on_policy, target_license

    assert hub_id("Qwen/Qwen3-8B") == "Qwen/Qwen3-8B"
    snapshot = "/data/hub/models--meta-llama--Llama-3.1-8B-Instruct/snapshots/0e9e39f/"
    assert hub_id(snapshot) == "meta-llama/Llama-3.1-8B-Instruct"
    assert hub_id(str(tmp_path)) is None and hub_id("./models/x") is None
    target = tmp_path / "target"
    target.mkdir()
    (target / "README.md").write_text(
        "---\nlicense: other\nlicense_name: llama3.1\ntags: [x]\n---\n# Model\n"
    )
    assert target_license(str(target), None, None) == {"license": "other", "license_name": "llama3.1"}
    assert target_license(str(tmp_path / "none"), None, None) == {}
    replies, chats = tmp_path / "onpolicy", tmp_path / "chats.jsonl"
    replies.mkdir()
    (replies / GENERATED).write_text("{}")
    chats.write_text("{}\n")
    assert on_policy([str(replies)]) is True and on_policy([str(chats)]) is False
    assert on_policy([str(tmp_path / "moved-away.jsonl")]) is None  # not where the cache recorded it: unknown


def test_two_exports_into_one_new_folder_at_once_the_second_is_refused(run_dir: Path, tmp_path: Path) -> None:
    """Two exports of different runs into one new folder at the same moment: one writes it, the other is refused
    in one line (busy, or another run's export once the first is in), never silently replaced."""
    import os

    from cli_argv import PEAGLE

    other = tmp_path / "other-run"
    shutil.copytree(run_dir, other)
    facts = json.loads((other / "run.json").read_text())
    facts["starts"][0]["time"] += 1.0
    (other / "run.json").write_text(json.dumps(facts))
    out = tmp_path / "draft"
    env = {**os.environ, export.SLEEP_ENV: "3", "OMP_NUM_THREADS": "1"}
    env.pop("PEAGLE_DEBUG", None)
    procs = {
        run: subprocess.Popen(
            [*PEAGLE, "export", str(run), "--output", str(out), "--checkpoint", "latest"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for run in (run_dir, other)
    }
    ends = {run: (p.wait(timeout=300), p.stderr.read()) for run, p in procs.items()}
    winners = [run for run, (code, _) in ends.items() if code == 0]
    assert len(winners) == 1, ends
    (loser,) = set(ends) - set(winners)
    code, err = ends[loser]
    assert code in (6, 7) and err.count("\n") == 1 and "Traceback" not in err, ends
    assert json.loads((out / MARKER_FILE).read_text())["run"] == str(winners[0].resolve())
