"""A real worker process (``python -m gpu_workers.pools.worker``'s arguments) whose model misbehaves when a
trigger token id is in a forward's input: ``--fault device`` raises a CUDA-style device error from then on,
``--fault slow:SECONDS`` sleeps that long once. Run as ``python -m tests.faulty_worker --fault ... --trigger
ID <worker arguments>`` from the repository root.
"""

from __future__ import annotations

import argparse
import sys

import gpu_workers.model as model_package
from gpu_workers.pools import worker
from tests.model_faults import FaultyModel, device_error, sleep


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fault", required=True, help="device | slow:SECONDS")
    parser.add_argument("--trigger", required=True, help="comma-separated token ids")
    args, worker_args = parser.parse_known_args()
    if args.fault == "device":
        flags = {"fault": device_error, "sticky": True}
    else:
        flags = {"fault": sleep(float(args.fault.split(":", 1)[1])), "once": True}
    load_model = model_package.load_model

    def faulty_load_model(*a, **kw):
        return FaultyModel(load_model(*a, **kw), [int(t) for t in args.trigger.split(",")], **flags)

    model_package.load_model = faulty_load_model  # Engine.from_pretrained looks it up when it loads
    return worker.main(worker_args)


if __name__ == "__main__":
    sys.exit(main())
