"""The long form of the kill tests: real 2-rank save jobs SIGKILLed at random instants, many times
per destination, each checked as ``tests/dist/test_kill_dist.py`` checks it (the path loads as
exactly the old or the new checkpoint through hp-dcp-hf and transformers; after repair or the next
save nothing is left behind). An assertion stops the run at the first violation.

    python -m bench.kill_saves --tries 40 [--destinations local,s3] [--out bench/results/kills.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import warnings
from pathlib import Path

from tests.dist.test_kill_dist import BUCKET, NEW, OLD, Place, random_kills
from tests.support.families import save_family_model
from tests.support.save_jobs import SHARD, Zygote, build_model
from tests.support.servers.s3 import MotoS3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tries", type=int, default=40, help="random kills per destination")
    parser.add_argument("--destinations", default="local,s3")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default=None, help="also write the outcomes as JSON here")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = build_model(OLD)
        olds = {"same names": save_family_model(model, root / "same", SHARD),
                "one file": save_family_model(model, root / "one")}
        states = {"old": model.state_dict(), "new": build_model(NEW).state_dict()}
        zygote = Zygote(root / "jobs")
        moto = None
        results = {}
        try:
            for kind in args.destinations.split(","):
                if kind == "s3" and moto is None:
                    moto = MotoS3(root / "recording.jsonl")
                    moto.create_bucket(BUCKET)
                start = time.perf_counter()
                place = Place(kind, root / kind if kind == "local" else root, moto)
                (root / kind).mkdir(exist_ok=True)
                outcomes = random_kills(zygote, place, olds, states, args.tries, seed=args.seed)
                results[kind] = {**outcomes, "tries": args.tries, "violations": 0,
                                 "seconds": round(time.perf_counter() - start, 1)}
                print(f"{kind}: {json.dumps(results[kind])}", flush=True)
        finally:
            zygote.close()
            if moto is not None:
                moto.stop()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
