"""Regional compilation: compile one block and reuse it for every block of the model.

    python examples/regional_compile.py [--engine eager|compiled|cudagraph]

``Trainer(compile_regions=True)`` finds the repeated blocks (here the ``Block`` modules of
``Classifier.blocks``) and compiles one for all: with ``engine="eager"`` each block runs through
one shared compiled graph; with the compiled engines, which compile the whole step, the step's
trace breaks at each block and the block runs that same shared graph. Either way
compile time grows little with depth. benchmarks/regional_compile.py measures the first step
against whole-model compilation.
"""

import argparse
import time

import torch

from fasttrain import Trainer
from fasttrain.regional import compiled_region_names

from _tiny import Classifier, datasets


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--engine", choices=["eager", "compiled", "cudagraph"], default="eager")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = Classifier(blocks=args.blocks)
    train, _ = datasets(n_train=128)
    trainer = Trainer(model, torch.nn.CrossEntropyLoss(), torch.optim.AdamW(model.parameters(), lr=0.01),
                      callbacks=[], engine=args.engine, compile_regions=True)
    start = time.perf_counter()
    trainer.train(train, num_epochs=1, per_device_batch_size=32, train_dataloader_kwargs={"num_workers": 0})
    print(f"compiled {compiled_region_names(trainer.model)}; first epoch {time.perf_counter() - start:.1f}s; "
          f"train loss {trainer.run_history.get_latest_metric('train_loss_epoch'):.5f}")
    return trainer


if __name__ == "__main__":
    main()
