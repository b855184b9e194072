"""A Hugging Face DatasetDict saved to disk: `extract` and `generate` read its `train` split, or the
one `--split` names, and say which in their summary; the test split never ends up in a training cache unannounced.

The DatasetDict is written in the layout `DatasetDict.save_to_disk` writes (Arrow IPC stream files, state.json per
split, dataset_dict.json), with pyarrow: the reader does not need `datasets`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
from cli_run import peagle

from peagle_pipeline.cache.reader import open_cache
from peagle_pipeline.data.onpolicy_files import rows_file


def _split(path: Path, conversations: list[list[dict]]) -> None:
    path.mkdir(parents=True)
    table = pa.table({"messages": conversations})
    with pa.OSFile(str(path / "data-00000-of-00001.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    state = {"_data_files": [{"filename": "data-00000-of-00001.arrow"}], "_split": path.name}
    (path / "state.json").write_text(json.dumps(state))


def _dataset_dict(root: Path) -> Path:
    def chat(q: str) -> list[dict]:
        return [{"role": "user", "content": q}, {"role": "assistant", "content": f"The answer to {q}"}]

    _split(root / "train", [chat(f"train question {i}") for i in range(3)])
    _split(root / "test", [chat(f"test question {i}") for i in range(2)])
    (root / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    return root


def test_extract_reads_the_train_split_or_the_named_one_and_says_so(tiny_model, tmp_path):
    dd = _dataset_dict(tmp_path / "dd")
    common = ["--model", str(tiny_model), "--data", str(dd), "--dtype", "fp32", "--max-length", "64"]
    proc = peagle("extract", *common, "--output", str(tmp_path / "train"))
    assert f"note: read split 'train' of the Hugging Face DatasetDict {dd} (not read: test" in proc.stdout
    cache = open_cache(tmp_path / "train")
    assert len(cache.samples) == 3 and set(cache.samples["source"]) == {str(dd / "train")}
    proc = peagle("extract", *common, "--split", "test", "--output", str(tmp_path / "test"))
    assert "note: read split 'test'" in proc.stdout
    assert set(open_cache(tmp_path / "test").samples["source"]) == {str(dd / "test")}
    proc = peagle("extract", *common, "--split", "dev", "--output", str(tmp_path / "dev"), check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "has no split 'dev'" in proc.stderr
    assert not (tmp_path / "dev").exists()


def test_generate_reads_the_train_split_and_says_so(tiny_stop_model, tmp_path):
    dd = _dataset_dict(tmp_path / "dd")
    out = tmp_path / "gen"
    flags = ["--backend", "hf", "--device", "cpu", "--compute-dtype", "fp32", "--max-new-tokens", "8"]
    proc = peagle(
        "generate", "--model", str(tiny_stop_model), "--data", str(dd), "--output", str(out), *flags
    )
    assert f"note: read split 'train' of the Hugging Face DatasetDict {dd}" in proc.stdout
    seen = [json.loads(line) for line in (out / "rejects-rank00000-of-00001.jsonl").read_text().splitlines()]
    seen += [json.loads(line) for line in (out / rows_file(0, 1)).read_text().splitlines()]
    assert seen and {r["source"] for r in seen} == {str(dd / "train")}
