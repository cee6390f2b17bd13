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

from conftest import BACKEND

_SCRIPT = textwrap.dedent("""
    import numpy as np, keras, keras_autovm
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8, 8, 3)),
        keras.layers.Conv2D(8, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(8, 3, padding="same", activation="relu"),
        keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(4)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.random.rand(36, 8, 8, 3), np.random.rand(36, 4)
    for verbose in (1, 2):
        print(f"== fit verbose={verbose}", flush=True)
        callback = keras_autovm.AutoVM(budget="64MiB", apply_without_gpu=True)
        # 36 samples in batches of 8: a last batch of 4 gets its own plan,
        # mid-epoch, where the backend traces it with its size.
        model.fit(x, y, batch_size=8, epochs=2, callbacks=[callback],
                  verbose=verbose)
""")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _run_in_terminal(script):
    leader, follower = pty.openpty()
    env = dict(os.environ, PYTHONPATH=os.getcwd(), TF_CPP_MIN_LOG_LEVEL="3")
    child = subprocess.Popen([sys.executable, "-c", script], stdin=follower,
                             stdout=follower, stderr=subprocess.DEVNULL, env=env)
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
    verbose1, verbose2 = _run_in_terminal(_SCRIPT).split("== fit verbose=2")
    for part in (verbose1, verbose2):
        lines = _lines(part)
        for line in lines:
            if "AutoVM" in line:
                # A line of its own: nothing of the bar before it.
                assert line.startswith("AutoVM"), repr(line)
        for epoch in (1, 2):
            at = next(i for i, line in enumerate(lines)
                      if line.startswith(f"AutoVM epoch {epoch}/2"))
            # After the bar has finished the epoch's line (5 of 5 steps).
            assert "5/5" in lines[at - 1] and "loss" in lines[at - 1], lines[at - 1]
    lines = _lines(verbose1)
    if BACKEND != "tensorflow":  # TensorFlow traces one step for all sizes.
        assert "AutoVM plan for batch size 4:" in lines, verbose1
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
