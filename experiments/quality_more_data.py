"""What more distinct data and more steps buy `make quality`'s main draft, measured in vLLM (after `make quality`).

    python experiments/quality_more_data.py --dir .quality [--records 400] [--steps 2400]

The main draft of a finished `make quality` run (DIR/runs/main) trains on the run's four caches for its steps. This
trains a second one on the same caches plus the original replies of the next `--records` ShareGPT records
(extracted off-policy: ShareGPT records 400 to 400 + N, after the run's sources, before the held-out ones) for
`--steps` steps, with every other setting of quality.py's TRAIN, and measures both drafts in one `evaluate` run
(MT-Bench and the held-out prompts, K = 4, T = 0, as the run's curve). Prints the table and each stage's time;
writes DIR/more_data.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import quality as q


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=q.DEFAULT_DIR, help="a finished `make quality` directory")
    ap.add_argument(
        "--records", type=int, default=400, help="ShareGPT records extracted off-policy beside the run's"
    )
    ap.add_argument("--steps", type=int, default=2400, help="steps of the second main draft (multiple of 4)")
    args = ap.parse_args()
    root = (q.REPO / args.dir).resolve()
    main_export = root / "runs" / "main" / "export"
    heldout = root / "data" / "heldout_prompts.jsonl"
    if not (main_export / "config.json").exists() or not heldout.exists():
        raise q.QualityError(f"{root} holds no finished `make quality` run (runs/main/export)", 2)
    s = dict(q.BASE)
    first = s["source_conversations"]
    times: dict[str, float] = {}

    def timed(label: str, fn, *a, **k):
        q.say(label)
        start = time.time()
        out = fn(*a, **k)
        times[label] = round(time.time() - start, 1)
        return out

    sources = root / "data" / f"extra_sources_{first}_{first + args.records}.jsonl"
    if not sources.exists():
        with open(q.SHAREGPT, encoding="utf-8") as f:
            lines = f.readlines()
        q._write_atomic(sources, "".join(lines[first : first + args.records]))
    extra = timed(
        "extract: off-policy, more records", q.extract, root, f"off-policy-{args.records}", sources, s
    )
    caches = root / "caches"
    run = timed(
        "train: main draft on more data",
        q.train,
        root,
        f"main-more-{args.records}-{args.steps}",
        caches / "on-multi",
        args.steps,
        extra_cache=[str(caches / n) for n in ("on-single", "on-greedy", "off-policy")] + [str(extra)],
    )
    report = timed(
        "evaluate: both main drafts",
        q.evaluate,
        root,
        f"more-{args.records}-{args.steps}",
        [main_export, run / "export"],
        heldout,
        s,
    )
    results = q.results_by_draft(report)
    rows = [
        q._row("main (the run's)", root / "runs" / "main", results, main_export, s["main_steps"]),
        q._row(f"+{args.records} records, {args.steps} steps", run, results, run / "export", args.steps),
    ]
    print("| draft | MT-Bench AL | per position | held-out AL | per position | trainer est. AL | speedup |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(q._doc_row(r))
    print("stage times: " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in times.items()))
    out = {
        "records": args.records,
        "steps": args.steps,
        "rows": rows,
        "times_s": times,
        "host": report.get("hardware"),
    }
    (root / "more_data.json").write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except q.QualityError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(err.code)
