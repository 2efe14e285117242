"""A plain training loop that builds its DataLoader from a saved tuning result.

Tune once (``python examples/image_pipeline.py``, or ``autoloader tune ...``), then train
as often as you like with the settings it found:

    python examples/train_with_best.py image.json [--epochs 2]

Nothing here tunes: ``autoloader.load`` reads the JSON (warning if it was measured on
another machine) and ``make_loader`` builds the DataLoader with the tuned settings, the
batch size and the fixed options (``shuffle``...) of the tuning run; ``apply_threads``
sets the step's torch threads where they were tuned (a setting of the process, which
no loader carries).
"""

from __future__ import annotations

import argparse
import time
import warnings

from image_pipeline import JpegDataset, TrainStep  # examples/ is on the path when run

import autoloader


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result", help="a JSON file saved by a tuning run")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--items", type=int, default=4096)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    tuned = autoloader.load(args.result)
    print(f"settings from {args.result}: {tuned.params}")
    dataset = JpegDataset(args.items)
    step = TrainStep(args.device)
    # The tuned worker count may exceed the CPUs on purpose; torch warns each epoch.
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    loader = tuned.make_loader(dataset)
    tuned.apply_threads()  # the step's torch threads, where they were tuned
    print(
        f"loader: num_workers={loader.num_workers}, prefetch_factor={loader.prefetch_factor}, "
        f"persistent_workers={loader.persistent_workers}, pin_memory={loader.pin_memory}"
    )
    for epoch in range(args.epochs):
        started, losses, samples = time.perf_counter(), [], 0
        for batch in loader:
            losses.append(step(batch))
            samples += len(batch[1])
        seconds = time.perf_counter() - started
        print(
            f"epoch {epoch}: {samples} of {len(dataset)} samples, {samples / seconds:,.0f} "
            f"samples/s, mean loss {sum(losses) / len(losses):.3f}"
        )


if __name__ == "__main__":
    main()
