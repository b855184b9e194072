"""The disk an extraction needs, said before it starts: the estimate against the real caches it predicts, the
refusal on a real file system too small for it (a size-limited tmpfs) before the model loads, `--no-space-check`,
`extract --plan` without weights, and an object-store output (not checked, and said so)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_run import peagle

from peagle_pipeline.cache import estimate as sizes
from peagle_pipeline.cli import main
from peagle_pipeline.config import ExtractConfig
from peagle_pipeline.data.chat import ChatRenderer
from peagle_pipeline.model_dir import load_tokenizer, read_target_info
from peagle_pipeline.stages.extract import plan
from peagle_pipeline.stages.extract.settings import settle

pytestmark = pytest.mark.slow

# tiny_cache's settings (tests/integration/conftest.py)
FLAGS = ["--dtype", "fp32", "--max-length", "256", "--shard-tokens", "2048", "--chunk-tokens", "256"]


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _estimate(model: Path, data: Path, out: Path, **settings: object) -> plan.Estimate:
    cfg = ExtractConfig(model=str(model), data=[str(data)], output=str(out), **settings)  # type: ignore[arg-type]
    info = read_target_info(model)
    renderer = ChatRenderer(load_tokenizer(str(model)), cfg.assistant_turns, cfg.leading_assistant)
    return plan.estimate(settle(cfg, info, None, "cpu", (0, 1)), renderer)


def test_the_estimate_is_within_10_percent_of_the_cache_it_predicts(
    tiny_model: Path, conversations: Path, tiny_cache: Path, tmp_path: Path
) -> None:
    est = _estimate(tiny_model, conversations, tmp_path / "c", dtype="fp32", max_length=256, shard_tokens=2048,
                    chunk_tokens=256)  # fmt: skip
    assert est.count.step == 1 and est.count.rows == 40
    actual = _du(tiny_cache)
    assert abs(est.total - actual) / actual < 0.10, (est.describe(), actual)
    # every 3rd row tokenised: the scaled count stays close to the full pass
    cfg = ExtractConfig(
        model=str(tiny_model), data=[str(conversations)], output=str(tmp_path / "c"), max_length=256
    )
    renderer = ChatRenderer(load_tokenizer(str(tiny_model)), "all", "context")
    sampled = plan.count_tokens(
        settle(cfg, read_target_info(tiny_model), None, "cpu", (0, 1)), renderer, sample_rows=14
    )
    assert sampled.step == 3 and sampled.sampled == 14
    assert abs(sampled.tokens * sampled.scale - est.count.tokens) / est.count.tokens < 0.25


@contextlib.contextmanager
def _small_tmpfs(where: Path, size: str) -> Iterator[Path]:
    where.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)]).returncode
    ):
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def _weightless(tiny_model: Path, where: Path) -> Path:
    """The tiny model's config and tokenizer without its weights: a run that got as far as loading them fails."""
    shutil.copytree(tiny_model, where, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    return where


def test_a_file_system_too_small_is_refused_before_the_model_loads(
    tiny_model: Path, conversations: Path, tmp_path: Path
) -> None:
    model = _weightless(tiny_model, tmp_path / "model")
    with _small_tmpfs(tmp_path / "mnt", "512k") as mnt:
        out = mnt / "cache"
        proc = peagle("extract", "--model", str(model), "--data", str(conversations), "--output", str(out),
                      *FLAGS, check=False)  # fmt: skip
        lines = [line for line in proc.stderr.splitlines() if line.startswith("error")]
        assert proc.code == 9 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert "estimated cache size" in lines[0] and f"free in {mnt}" in lines[0], lines[0]
        assert "--no-space-check" in lines[0]
        assert list(mnt.iterdir()) == []  # nothing written
        # the override: the run goes on, to the model load (which fails here: the weights are missing)
        proc = peagle("extract", "--model", str(model), "--data", str(conversations), "--output", str(out),
                      *FLAGS, "--no-space-check", check=False)  # fmt: skip
        assert proc.code not in (0, 9) and "not enough free space" not in proc.stderr, proc.stderr
        assert "safetensors" in proc.stderr or "weights" in proc.stderr, proc.stderr


def test_plan_prints_the_estimate_without_weights_and_writes_nothing(
    tiny_model: Path, conversations: Path, tmp_path: Path, capsys
) -> None:
    model = _weightless(tiny_model, tmp_path / "model")
    out = tmp_path / "cache"
    args = ["extract", "--plan", "--model", str(model), "--data", str(conversations), *FLAGS]
    assert main([*args, "--output", str(out)]) == 0
    printed = capsys.readouterr().out.strip()
    est = _estimate(
        model, conversations, out, dtype="fp32", max_length=256, shard_tokens=2048, chunk_tokens=256
    )
    assert printed.startswith(est.describe()) and "free in" in printed and not out.exists()
    assert main([*args, "--output", "s3://bucket/cache"]) == 0
    assert "free space not checked: the output is an object store" in capsys.readouterr().out
    # the 4-bit cache's estimate: its hidden states at 0.42x bf16's bytes on this tiny target (H = 64)
    bf16 = _estimate(model, conversations, out, dtype="bf16")
    nf4 = _estimate(model, conversations, out, dtype="nf4")
    aux = [sizes.bytes_per_token(e.shape)["aux_hidden"] for e in (bf16, nf4)]
    assert nf4.tokens == bf16.tokens and 0.42 < aux[1] / aux[0] < 0.43 and nf4.per_token < bf16.per_token


def test_a_finished_cache_on_a_full_disk_is_not_refused(
    tiny_model: Path, conversations: Path, tmp_path: Path
) -> None:
    """A resumed cache is checked for what it still lacks, and a finished one not at all: the estimate of a tiny
    random target's cache runs ~12 % over it, which a full disk must not turn into a refusal of a no-op re-run."""
    with _small_tmpfs(tmp_path / "mnt", "3m") as mnt:
        argv = ["extract", "--model", str(tiny_model), "--data", str(conversations), "--output", str(mnt / "cache"),
                "--dtype", "nf4", *FLAGS[2:]]  # fmt: skip
        first = peagle(*argv, check=False)
        assert first.code == 0 and "estimated cache size" in first.stderr, first.stderr[-2000:]
        filler = mnt / "filler"
        filler.write_bytes(b"\0" * max(0, shutil.disk_usage(mnt).free - 50_000))
        again = peagle(*argv, check=False)
        assert again.code == 0 and "already complete" in again.stdout, again.stderr[-2000:]
        assert "not enough free space" not in again.stderr
