"""What the GPU recipes share: a measurement run in its own process (nothing
of an earlier run stays on the device), and a per-step timer."""

import argparse
import contextlib
import json
import os
import subprocess
import time

RESULT = "RESULT "


def report(result):
    """Prints a child's result as the one line `run_child` reads."""
    print(RESULT + json.dumps(result), flush=True)


def child_arguments(parser, timeout, variant=False):
    """Adds what a recipe that runs each measurement in a child process
    takes: `--timeout` (seconds per child, default `timeout`), `--out`, and
    the hidden `--child` (and `--variant`) the parent passes its children."""
    parser.add_argument("--timeout", type=int, default=timeout)
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    if variant:
        parser.add_argument("--variant", default=None, help=argparse.SUPPRESS)


def run_child(command, timeout, env=None, **identity):
    """Runs `command` and returns the dict its `RESULT` line carries, with
    `status="ok"`; else `identity` with the status (`"timeout"`, or
    `"error"` and the tail of its output)."""
    try:
        done = subprocess.run(command, capture_output=True, text=True,
                              timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return dict(identity, status="timeout")
    for line in done.stdout.splitlines():
        if line.startswith(RESULT):
            return dict(json.loads(line[len(RESULT):]), status="ok")
    return dict(identity, status="error", log_tail=(done.stdout + done.stderr)[-3000:])


def step_timer(keras):
    """A callback timing each training step of the last epoch, from its
    start to its loss read back (which waits for the device)."""

    class Timer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times = []

        def on_epoch_begin(self, epoch, logs=None):
            self.times = []

        def on_train_batch_begin(self, batch, logs=None):
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            float(logs["loss"])
            self.times.append(time.perf_counter() - self.start)

    return Timer()


def save(results, out):
    """Writes `results` as JSON to `out` (a path, or `None`: nothing)."""
    if not out:
        return
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)


@contextlib.contextmanager
def backward_marks(torch, all_streams=True, arrival=False):
    """While open, every `Tensor.backward` call (Keras's torch step makes
    one) waits for the device before and after it and appends the two
    times to the yielded list: a step's forward, backward and the rest.
    With `all_streams=False` it waits for the compute stream only, so
    that copies still running on other streams are not counted where
    they end but where compute waits for them. With `arrival`, the time
    the call came, before the first wait, is appended first (three marks
    a call): how long the device then took to catch up."""
    marks, backward = [], torch.Tensor.backward
    sync = lambda: None  # noqa: E731
    if torch.cuda.is_available():
        sync = (torch.cuda.synchronize if all_streams
                else lambda: torch.cuda.current_stream().synchronize())

    def timed(tensor, *args, **kwargs):
        if arrival:
            marks.append(time.perf_counter())
        sync()
        marks.append(time.perf_counter())
        backward(tensor, *args, **kwargs)
        sync()
        marks.append(time.perf_counter())

    torch.Tensor.backward = timed
    try:
        yield marks
    finally:
        torch.Tensor.backward = backward
