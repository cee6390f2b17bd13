"""AutoVM's printing, kept off the lines of Keras's progress bar.

Keras's progress bar (`fit(verbose=1)`) redraws one line in place and ends
it only when the epoch ends, in its `on_epoch_end`, which runs after every
user callback's. So a line printed mid-epoch would land on the bar's line,
and a line printed in `AutoVM.on_epoch_end` before the bar's last update.
The `Console` starts mid-epoch lines on a line of their own, and holds what
is printed at an epoch's end (the epoch line, a plan remade on
recalibration) until the bar has finished its line (the next
`on_epoch_begin`, or `on_train_end`). Its warnings (`warn`), which Python
writes to stderr, the same terminal, follow the same rules.
"""

import logging
import sys
import warnings

import keras

_LOG = logging.getLogger("keras_autovm")


class Console:
    """Where AutoVM's lines go during one `fit`.

    Args:
        verbose: AutoVM's `verbose`; 0 prints nothing.
    """

    def __init__(self, verbose):
        self.verbose = verbose
        self._bar_verbose = 0
        self._bar_open = False
        self._holding = False
        self._held = []

    def fit_begins(self, params):
        """Notes how `fit` reports progress (its `verbose`)."""
        verbose = (params or {}).get("verbose", 0)
        # `fit`'s default, "auto", draws the bar as 1 does.
        self._bar_verbose = 1 if verbose == "auto" else verbose
        self._bar_open = self._holding = False
        self._held = []

    def batch_ended(self):
        """Called in `on_train_batch_end`: the bar draws its line after us."""
        self._bar_open = self._bar_verbose == 1

    def epoch_ended(self):
        """Called in `on_epoch_end`: the bar ends its line after us, so
        lines wait for `flush`."""
        self._bar_open = False
        self._holding = True

    def print(self, text):
        """Prints `text` now, on a line of its own."""
        if self.verbose:
            self._emit(_write, text)

    def warn(self, message):
        """Warns (`UserWarning`) with `message`, whatever `verbose` is, on a
        line of its own: the bar's open line is ended first, and at an
        epoch's end the warning waits for `flush` as lines do."""
        self._emit(_warn, message)

    def print_later(self, text):
        """Prints `text` once the progress bar has finished its line."""
        if self.verbose:
            self._held.append((_write, text))

    def flush(self):
        """Prints the lines held back (the bar's line has ended)."""
        held, self._held, self._holding = self._held, [], False
        for show, text in held:
            show(text)

    def _emit(self, show, text):
        if self._holding:
            self._held.append((show, text))
            return
        if self._bar_open:
            _end_bar_line()
            self._bar_open = False
        show(text)


def _end_bar_line():
    if keras.config.is_interactive_logging_enabled():
        sys.stdout.write("\n")
        sys.stdout.flush()


def _warn(message):
    # Python writes warnings to stderr: what is on stdout goes first.
    sys.stdout.flush()
    warnings.warn(message, UserWarning, stacklevel=4)


def _write(text):
    # Keras's own rule (`io_utils.print_msg`): to stdout while interactive
    # logging is on, else to the logging system.
    if keras.config.is_interactive_logging_enabled():
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    else:
        for line in text.splitlines():
            _LOG.info(line)
