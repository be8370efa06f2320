"""Profile training steps with torch.profiler and open the trace in chrome://tracing or Perfetto.

    python examples/profiling.py --out profile --engine eager
    fasttrain bench --profile --workload mlp     # the same for a benchmark workload, with a summary

Steps 0-1 are skipped (compilation and graph capture happen there), step 2 warms up, steps 3-5
are recorded. ``--memory`` adds an HTML memory timeline.
"""

import argparse

import torch

from fasttrain import Trainer
from fasttrain.profiling import ProfilerCallback

from _tiny import Classifier, datasets


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="profile")
    parser.add_argument("--engine", default="auto")
    parser.add_argument("--memory", action="store_true")
    args = parser.parse_args(argv)
    profiler = ProfilerCallback(args.out, skip_first=2, wait=0, warmup=1, active=3, record_memory=args.memory)
    torch.manual_seed(0)
    model = Classifier()
    train, _ = datasets()
    trainer = Trainer(model, torch.nn.CrossEntropyLoss(), torch.optim.AdamW(model.parameters(), lr=0.01),
                      callbacks=[profiler], engine=args.engine)
    trainer.train(train, num_epochs=1, per_device_batch_size=32, train_dataloader_kwargs={"num_workers": 0})
    print("wrote", ", ".join(profiler.trace_paths))
    return profiler


if __name__ == "__main__":
    main()
