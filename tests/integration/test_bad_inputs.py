"""Every case of the bad-input corpus (`tests/fixtures/bad_inputs/NN-name/`) through the real CLI: in process
(tests/cli_run.py), or as a process for the cases about one (Ctrl-C, a file-size limit, dropped capabilities).

Each case folder holds its input files and an `expected.json`:
    command            argv after `peagle-pipeline`, with placeholders {model} {case} {out} {cache} {base_cache}
                       {run} {data} {tmp} (see `_placeholders`)
    setup              null or a named setup step (see `SETUPS`) that prepares {cache} / {run} / {model} / {out}
    exit_code          the expected exit status
    error_contains     substrings of the one `error: ...` line on stderr (exit != 0). It is the only stderr line,
                       except for `train`, whose status lines (e.g. the draft vocabulary's coverage, printed
                       at the start) may precede it when it fails during training; it is then the last line.
    reject_reason_contains   the row-level reject reason recorded in the cache (exit 0)
    stdout_contains    optional substrings of stdout (verify lists the damaged store and samples there)
    creates_nothing    optional: the command must fail before creating {out}
    skip_if_importable optional: a module whose presence makes the case moot (vllm-check without vLLM)
    mode               optional: "rlimit_fsize" (files capped with RLIMIT_FSIZE, SIGXFSZ ignored, so writes fail
                       with EFBIG) or "sigint" (Ctrl-C after the first commit); both then re-run the command
                       normally and require the cache to equal the uninterrupted one (`tiny_cache`).
                       "read_only": the folder `read_only` names (a placeholder path) is created with mode 0555
                       and the command runs without the root capabilities that bypass file modes (as root, the
                       CAP_DAC_* capabilities are dropped from its bounding set), as an ordinary user would.
Every pre-existing tree a case reads (cache, run, model, case folder, data) is hashed before and after: a failed
command must leave it byte-for-byte untouched.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cache_compare import assert_same_cache
from cli_argv import EXTRACT_START, PEAGLE, start_cli
from cli_run import peagle, run_cli

from peagle_pipeline.cache import layout
from peagle_pipeline.cache.reader import open_cache
from peagle_pipeline.cache.verify import verify_cache

pytestmark = pytest.mark.slow

CASES_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "bad_inputs"
CASES = sorted(p.name for p in CASES_DIR.iterdir() if (p / "expected.json").is_file())
STORE = layout.store_name(0, 1)
# The base training run of the "run" setups: the flags the resume cases repeat (26 changes lr). 256 tokens per
# step hold every sample of the tiny cache whole, so no truncation note joins the one error line.
RUN_FLAGS = [
    "--depths",
    "2",
    "--tokens-per-step",
    "256",
    "--steps",
    "2",
    "--eval-samples",
    "0",
    "--precision",
    "fp32",
    "--draft-vocab-size",
    "300",
    "--num-workers",
    "0",
    "--save-every",
    "1",
    "--warmup",
    "0",
    "--no-export",
]


def tree_digest(path: Path) -> str:
    """sha256 over the relative names and bytes of every file under `path` (or of the file itself)."""
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file() or p.is_symlink())
    for f in files:
        h.update(str(f.relative_to(path) if f != path else f.name).encode() + b"\0")
        h.update(os.readlink(f).encode() if f.is_symlink() else f.read_bytes())
    return h.hexdigest()


# ------------------------------------------------------------------------------------------------ setups
def _copy_cache(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _model_copy(model: Path, dst: Path) -> Path:
    """A copy of the tiny model directory (weights symlinked: they are never read in these cases)."""
    dst.mkdir()
    for f in model.iterdir():
        if f.suffix == ".safetensors":
            (dst / f.name).symlink_to(f)
        else:
            shutil.copy(f, dst / f.name)
    return dst


def setup_cache(ph: dict[str, str], fx: dict[str, Path]) -> None:
    _copy_cache(fx["cache"], Path(ph["cache"]))


def setup_cache_old_format(ph: dict[str, str], fx: dict[str, Path]) -> None:
    cache = _copy_cache(fx["cache"], Path(ph["cache"]))
    meta = json.loads((cache / layout.CACHE_META).read_text())
    meta["format_version"] = 0
    (cache / layout.CACHE_META).write_text(json.dumps(meta))


def setup_cache_missing_store(ph: dict[str, str], fx: dict[str, Path]) -> None:
    cache = _copy_cache(fx["cache"], Path(ph["cache"]))
    shutil.rmtree(cache / layout.STORES_DIR / STORE)


def setup_cache_truncated_store(ph: dict[str, str], fx: dict[str, Path]) -> None:
    """Cut the last 100 bytes (the shard index and chunk tail) of every aux_hidden shard file."""
    cache = _copy_cache(fx["cache"], Path(ph["cache"]))
    shards = sorted((cache / layout.STORES_DIR / STORE / "aux_hidden" / "c").rglob("0"))
    shards = [s for s in shards if s.is_file()]
    assert len(shards) >= 2
    for shard in shards:
        blob = shard.read_bytes()
        shard.write_bytes(blob[:-100])


def setup_cache_damaged_meta(ph: dict[str, str], fx: dict[str, Path]) -> None:
    cache = _copy_cache(fx["cache"], Path(ph["cache"]))
    (cache / layout.CACHE_META).write_bytes(b"\x00garbage{{")


def setup_run(ph: dict[str, str], fx: dict[str, Path]) -> None:
    shutil.copytree(fx["run"], ph["run"])


def setup_run_damaged_draft_json(ph: dict[str, str], fx: dict[str, Path]) -> None:
    run = Path(shutil.copytree(fx["run"], ph["run"]))
    (run / "draft.json").write_text('{"target_config": {"vocab_size": 5')


def setup_run_damaged_checkpoint(ph: dict[str, str], fx: dict[str, Path]) -> None:
    """The latest checkpoint's weights cut in half (a copy interrupted, a flaky disk)."""
    run = Path(shutil.copytree(fx["run"], ph["run"]))
    weights = run / "checkpoints" / "step-00000002" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


def setup_run_export_with_readme(ph: dict[str, str], fx: dict[str, Path]) -> None:
    """{run} exported to {out}, then the user puts a README.md of their own there (in place of the card)."""
    from peagle_pipeline.stages.export.stage import export_run

    shutil.copytree(fx["run"], ph["run"])
    export_run(ph["run"], ph["out"], checkpoint="latest")
    (Path(ph["out"]) / "README.md").write_text("# my draft\n")


def setup_run_other_export(ph: dict[str, str], fx: dict[str, Path]) -> None:
    """{out} holds the export of another run (its marker names another run folder and start)."""
    from peagle_pipeline.stages.export.marker import MARKER_FILE
    from peagle_pipeline.stages.export.stage import export_run

    shutil.copytree(fx["run"], ph["run"])
    export_run(ph["run"], ph["out"], checkpoint="latest")
    marker = Path(ph["out"]) / MARKER_FILE
    facts = json.loads(marker.read_text())
    facts.update(run="/runs/another-run", run_started=12345.0)
    marker.write_text(json.dumps(facts))


def setup_cache_truncated_manifest(ph: dict[str, str], fx: dict[str, Path]) -> None:
    """The store's manifest.json cut in half (a damaged copy; the writer itself replaces it atomically)."""
    cache = _copy_cache(fx["cache"], Path(ph["cache"]))
    manifest = cache / layout.STORES_DIR / STORE / layout.MANIFEST
    blob = manifest.read_bytes()
    manifest.write_bytes(blob[: len(blob) // 2])


def setup_foreign_output(ph: dict[str, str], fx: dict[str, Path]) -> None:
    out = Path(ph["out"])
    out.mkdir()
    (out / "notes.txt").write_text("my notes, not a cache\n")


def setup_model_garbage_config(ph: dict[str, str], fx: dict[str, Path]) -> None:
    model = _model_copy(fx["model"], Path(ph["tmp"]) / "model")
    (model / "config.json").write_text("{not json at all")
    ph["model"] = str(model)


def setup_model_no_template(ph: dict[str, str], fx: dict[str, Path]) -> None:
    model = _model_copy(fx["model"], Path(ph["tmp"]) / "model")
    (model / "chat_template.jinja").unlink(missing_ok=True)
    tc = json.loads((model / "tokenizer_config.json").read_text())
    tc.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(tc))
    ph["model"] = str(model)


def setup_model_garbage_tokenizer(ph: dict[str, str], fx: dict[str, Path]) -> None:
    model = _model_copy(fx["model"], Path(ph["tmp"]) / "model")
    (model / "tokenizer.json").write_text('{"version": "1.0", "model": 12}')
    ph["model"] = str(model)


def setup_model_awq_config(ph: dict[str, str], fx: dict[str, Path]) -> None:
    model = _model_copy(fx["model"], Path(ph["tmp"]) / "model")
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm"}
    (model / "config.json").write_text(json.dumps(config))
    ph["model"] = str(model)


SETUPS = {
    "cache": setup_cache,
    "cache_old_format": setup_cache_old_format,
    "cache_missing_store": setup_cache_missing_store,
    "cache_truncated_store": setup_cache_truncated_store,
    "cache_damaged_meta": setup_cache_damaged_meta,
    "cache_truncated_manifest": setup_cache_truncated_manifest,
    "run": setup_run,
    "run_damaged_draft_json": setup_run_damaged_draft_json,
    "run_damaged_checkpoint": setup_run_damaged_checkpoint,
    "run_export_with_readme": setup_run_export_with_readme,
    "run_other_export": setup_run_other_export,
    "foreign_output": setup_foreign_output,
    "model_garbage_config": setup_model_garbage_config,
    "model_no_template": setup_model_no_template,
    "model_garbage_tokenizer": setup_model_garbage_tokenizer,
    "model_awq_config": setup_model_awq_config,
}


# ---------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def base_run(tiny_cache: Path, tmp_path_factory) -> Path:
    """A finished two-step training run on `tiny_cache` (checkpoints included) for the resume case."""
    out = tmp_path_factory.mktemp("bad-inputs-run") / "run"
    env = dict(os.environ, TQDM_DISABLE="1")
    peagle("train", "--cache", str(tiny_cache), "--output", str(out), *RUN_FLAGS, env=env)
    assert (out / "checkpoints").is_dir()
    return out


def _placeholders(
    case: str, tmp: Path, tiny_model: Path, tiny_cache: Path, conversations: Path
) -> dict[str, str]:
    return {
        "model": str(tiny_model),
        "case": str(CASES_DIR / case),
        "out": str(tmp / "out"),
        "cache": str(tmp / "cache"),
        "base_cache": str(tiny_cache),
        "run": str(tmp / "run"),
        "data": str(conversations),
        "tmp": str(tmp),
    }


def _argv(command: list[str], ph: dict[str, str]) -> list[str]:
    return [*PEAGLE, *(arg.format(**ph) for arg in command)]


def _limit_file_size(limit: int):  # type: ignore[no-untyped-def]
    def pre() -> None:  # runs in the child between fork and exec
        signal.signal(
            signal.SIGXFSZ, signal.SIG_IGN
        )  # writes past the limit fail with EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return pre


def _without_dac_override() -> None:
    """Runs in the child between fork and exec: as root, drop CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH from the
    bounding set, so after exec file modes apply (root still owns, and so reads, every test file)."""
    if os.geteuid() != 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")


def _run_sigint(argv: list[str], env: dict[str, str], out: Path) -> subprocess.CompletedProcess[str]:
    """Start the extraction with slowed commits (through the fork server, whose client passes SIGINT on), send
    SIGINT once its first commit is on disk."""
    slow = dict(env, PEAGLE_TEST_COMMIT_SLEEP="1.0")
    proc = start_cli(argv, slow, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    manifest = out / layout.STORES_DIR / STORE / layout.MANIFEST
    deadline = time.monotonic() + 240
    while not manifest.exists():
        assert proc.poll() is None, f"extraction ended before its first commit: {proc.stderr.read()}"
        assert time.monotonic() < deadline, "no commit within 240 s"
        time.sleep(0.02)
    assert not json.loads(manifest.read_text())["complete"]
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


# ------------------------------------------------------------------------------------------------- test
def test_corpus_has_the_required_cases() -> None:
    assert len(CASES) >= 28
    for case in CASES:
        exp = json.loads((CASES_DIR / case / "expected.json").read_text())
        assert exp["setup"] is None or exp["setup"] in SETUPS, case
        assert ("error_contains" in exp) != ("reject_reason_contains" in exp), case
        assert (exp["exit_code"] == 0) == ("reject_reason_contains" in exp), case


@pytest.mark.parametrize("case", CASES)
def test_bad_input(
    case: str,
    tmp_path: Path,
    tiny_model: Path,
    tiny_cache: Path,
    conversations: Path,
    request: pytest.FixtureRequest,
    cli_env: dict[str, str],
) -> None:
    exp = json.loads((CASES_DIR / case / "expected.json").read_text())
    if exp.get(
        "skip_if_importable"
    ):  # asked in a clean process: tests/ (on sys.path here) holds a vllm folder
        probe = f"import importlib.util as u; raise SystemExit(u.find_spec({exp['skip_if_importable']!r}) is None)"
        if subprocess.run([sys.executable, "-c", probe], cwd=tmp_path).returncode == 0:
            pytest.skip(f"{exp['skip_if_importable']} is installed here")
    ph = _placeholders(case, tmp_path, tiny_model, tiny_cache, conversations)
    fx = {"cache": tiny_cache, "model": tiny_model}
    if (exp["setup"] or "").startswith("run"):
        fx["run"] = request.getfixturevalue("base_run")
    if exp["setup"]:
        SETUPS[exp["setup"]](ph, fx)
    env = dict(cli_env, TQDM_DISABLE="1")
    out = Path(ph["out"])
    protected = [Path(ph[k]) for k in ("cache", "run", "base_cache", "model", "case", "data")]
    if out.exists():
        protected.append(out)
    before = {p: tree_digest(p) for p in protected if p.exists()}
    argv = _argv(exp["command"], ph)

    mode = exp.get("mode")
    if mode == "sigint":
        proc = _run_sigint(argv, env, out)
    elif mode == "read_only":
        read_only = Path(exp["read_only"].format(**ph))
        read_only.mkdir(parents=True)
        read_only.chmod(0o555)
        try:
            proc = subprocess.run(
                argv, env=env, capture_output=True, text=True, timeout=300, preexec_fn=_without_dac_override
            )
        finally:
            read_only.chmod(0o755)
        assert not any(read_only.iterdir()), "a command refused for a read-only output wrote into it"
    elif mode == "rlimit_fsize":  # the limit is set between fork and exec: a fresh interpreter
        preexec = _limit_file_size(int(exp["fsize_limit"]))
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, preexec_fn=preexec)
    else:  # a run to its end: in process
        proc = run_cli(argv, env)

    report = f"{case}: exit {proc.returncode}\nstdout: {proc.stdout[-2000:]}\nstderr: {proc.stderr[-3000:]}"
    assert proc.returncode == exp["exit_code"], report
    assert "Traceback" not in proc.stderr, report
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    if exp["exit_code"] != 0:
        # train's status lines before the error; extract's start line (the cache's estimated size), printed once
        # every check has passed, before a failure of the run itself
        status = (
            lines[:-1] if exp["command"][0] == "train" else [x for x in lines if x.startswith(EXTRACT_START)]
        )
        assert lines[len(status) :] == lines[-1:] and lines[-1].startswith("error: "), report
        assert not any(line.startswith("error") for line in status), report
        for part in exp["error_contains"]:
            assert part in lines[-1], f"{part!r} not in the error line\n{report}"
    else:
        assert not any(line.startswith("error") for line in lines), report
        rejects = open_cache(out).rejects
        assert rejects["reason"].str.contains(exp["reject_reason_contains"], regex=False).any(), (
            f"{rejects.to_dict('records')}\n{report}"
        )
    for part in exp.get("stdout_contains", []):
        assert part in proc.stdout, f"{part!r} not on stdout\n{report}"
    if exp.get("creates_nothing"):
        assert not out.exists(), f"{out} was created by a command that failed on its input"
    for path, digest in before.items():
        assert tree_digest(path) == digest, f"{case}: {path} changed"

    if mode in ("sigint", "rlimit_fsize"):  # nothing lost: the plain re-run equals the uninterrupted run
        if mode == "sigint":
            partial = open_cache(out, check=False)
            assert len(partial.samples) > 0 and verify_cache(partial) == [
                f"{STORE}: incomplete ({len(partial.samples)} samples committed); re-run extract to finish it"
            ]
        again = run_cli(argv, env)
        assert again.returncode == 0, again.stderr[-3000:]
        assert_same_cache(tiny_cache, out)
        assert verify_cache(open_cache(out)) == []
