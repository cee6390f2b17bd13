"""AutoVM's lines stay off Keras's progress bar, in a terminal.

Keras redraws its bar in place when stdout is a terminal, so the fit runs in
a child process on a pseudo-terminal and the test reads the bytes it wrote.
"""

import os
import pty
import re
import subprocess
import sys
import textwrap
import warnings

import pytest

from conftest import BACKEND

_SCRIPT = textwrap.dedent("""
    import warnings
    import numpy as np, keras, keras_autovm
    # One line a warning, to read them among the bar's lines.
    warnings.formatwarning = lambda m, c, *_, **__: f"{c.__name__}: {m}\\n"
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8, 8, 3)),
        keras.layers.Conv2D(8, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(8, 3, padding="same", activation="relu"),
        keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(4)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.random.rand(36, 8, 8, 3), np.random.rand(36, 4)

    class Warns(keras.callbacks.Callback):
        # AutoVM warns mid-step (a replan after running out of memory) and
        # at an epoch's end (a replan that failed); neither happens on a
        # CPU, so this says the same through AutoVM's console. Each text is
        # new: Python shows a repeated warning once.
        def __init__(self, autovm):
            super().__init__()
            self.autovm = autovm
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:
                self.autovm._console.warn(f"AutoVM mid-epoch warning {self.epoch}, {verbose}")
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch + 1
        def on_epoch_end(self, epoch, logs=None):
            self.autovm._console.warn(f"AutoVM epoch-end warning {self.epoch}, {verbose}")

    for verbose in ("auto", 1, 2):
        print(f"== fit verbose={verbose}", flush=True)
        callback = keras_autovm.AutoVM(budget="64MiB", apply_without_gpu=True)
        # 36 samples in batches of 8: a last batch of 4 gets its own plan,
        # mid-epoch, where the backend traces it with its size. "auto" is
        # fit's default.
        model.fit(x, y, batch_size=8, epochs=2, callbacks=[callback, Warns(callback)],
                  **({} if verbose == "auto" else {"verbose": verbose}))
""")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _run_in_terminal(script):
    leader, follower = pty.openpty()
    env = dict(os.environ, PYTHONPATH=os.getcwd(), TF_CPP_MIN_LOG_LEVEL="3")
    # Warnings go to stderr, the same terminal as the bar's stdout.
    child = subprocess.Popen([sys.executable, "-c", script], stdin=follower,
                             stdout=follower, stderr=follower, env=env)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # The child closed the terminal.
            break
        if not chunk:
            break
        chunks.append(chunk)
    assert child.wait(timeout=300) == 0
    os.close(leader)
    return b"".join(chunks).decode("utf-8", "replace")


def _lines(text):
    # A terminal line: what lies between line feeds. The bar's redraws
    # (backspaces, carriage returns) stay inside the line they redraw.
    return [_ANSI.sub("", line).rstrip("\r") for line in text.split("\n")]


def test_autovm_lines_stay_off_the_progress_bar():
    text = _run_in_terminal(_SCRIPT)
    fits = {}
    for part in text.split("== fit verbose=")[1:]:
        verbose, _, rest = part.partition("\n")
        fits[verbose.strip()] = _lines(rest)
    assert sorted(fits) == ["1", "2", "auto"], text
    for verbose, lines in fits.items():
        for line in lines:
            if "AutoVM" in line:
                # A line of its own: nothing of the bar before it.
                assert line.startswith(("AutoVM", "UserWarning: AutoVM")), repr(line)
        for epoch in (1, 2):
            at = next(i for i, line in enumerate(lines)
                      if line.startswith(f"AutoVM epoch {epoch}/2"))
            # After the bar has finished the epoch's line (5 of 5 steps).
            assert "5/5" in lines[at - 1] and "loss" in lines[at - 1], lines[at - 1]
            # A warning at the epoch's end waits for it too.
            assert lines[at + 1] == f"UserWarning: AutoVM epoch-end warning {epoch}, {verbose}", \
                lines[at - 1:at + 2]
            assert f"UserWarning: AutoVM mid-epoch warning {epoch}, {verbose}" in lines
        if verbose != "2":
            if BACKEND != "tensorflow":  # TensorFlow traces one step for all sizes.
                assert "AutoVM plan for batch size 4:" in lines, lines
            # The report follows the last epoch's line.
            last = next(i for i, line in enumerate(lines)
                        if line.startswith("AutoVM epoch 2/2"))
            assert lines.index("AutoVM report") > last


def test_console_holds_lines_printed_at_an_epoch_end(capsys):
    from keras_autovm.console import Console

    console = Console(verbose=1)
    console.fit_begins({"verbose": 1})
    console.batch_ended()  # The bar has drawn part of a line.
    console.print("mid-epoch plan")
    assert capsys.readouterr().out == "\nmid-epoch plan\n"
    console.batch_ended()
    console.epoch_ended()
    console.print("plan remade on recalibration")  # The bar's line is open.
    console.print_later("epoch line")
    assert capsys.readouterr().out == ""
    console.flush()  # The bar has finished its line.
    assert capsys.readouterr().out == "plan remade on recalibration\nepoch line\n"
    console.print("next")
    assert capsys.readouterr().out == "next\n"


def test_console_warnings_keep_to_lines_of_their_own(capsys):
    from keras_autovm.console import Console

    console = Console(verbose=0)  # Warnings are issued whatever `verbose` is.
    console.fit_begins({"verbose": "auto"})  # `fit`'s default draws a bar.
    console.batch_ended()
    with pytest.warns(UserWarning, match="mid-step"):
        console.warn("mid-step")
    assert capsys.readouterr().out == "\n"  # The bar's line ended first.
    console.batch_ended()
    console.epoch_ended()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        console.warn("at the epoch's end")
        assert not caught  # Held until the bar has finished its line.
        console.flush()
    assert [str(w.message) for w in caught] == ["at the epoch's end"]
