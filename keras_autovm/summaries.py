"""TensorBoard event files, written without TensorFlow.

On JAX and torch AutoVM may not import TensorFlow (it is slow to import and
claims GPU memory), so it writes TensorBoard's file format itself: records
framed as TFRecords (length, masked CRC-32C of the length, data, masked
CRC-32C of the data), each an `Event` protocol buffer encoded by hand. Only
the few fields AutoVM needs: a scalar's `simple_value`, and a text summary
(a string tensor tagged for TensorBoard's text plugin).
"""

import os
import socket
import struct
import time

_EVENT_WALL_TIME, _EVENT_STEP, _EVENT_FILE_VERSION, _EVENT_SUMMARY = 1, 2, 3, 5
_DT_STRING = 7


class EpochSummaries:
    """What AutoVM tells TensorBoard each epoch, in `<log_dir>/autovm`.

    Scalars (tags under `autovm/`; step: the 0-based epoch, as Keras's
    `TensorBoard` callback counts): `predicted_peak_bytes`,
    `measured_peak_bytes` (where the backend measures it),
    `step_time_s` (measured) and `predicted_step_time_s`,
    `planned_host_bytes_per_epoch`, `measured_host_bytes` (bytes moved
    so far in this fit, where the mechanism counts them: JAX's and torch's
    host copies, TensorFlow's managed mode; not TensorFlow's explicit
    copies) and
    `replans` (so far). Text: `autovm/plan`,
    the plan table, at each epoch whose plan is new.

    Args:
        log_dir: the TensorBoard log directory.
    """

    def __init__(self, log_dir):
        self.writer = EventWriter(os.path.join(log_dir, "autovm"))
        self.replans = 0
        self._last_plan = None

    def epoch(self, epoch, record, plan, moved=None):
        """Writes one epoch's `report.epoch_record` and, if new, its plan."""
        self.replans += bool(record.get("replanned"))
        self.writer.scalars(epoch, {
            "autovm/predicted_peak_bytes": record["predicted_peak_bytes"],
            "autovm/measured_peak_bytes": record["peak_bytes"],
            "autovm/step_time_s": record["step_time"],
            "autovm/predicted_step_time_s": record["predicted_step_time"],
            "autovm/planned_host_bytes_per_epoch":
                record["planned_host_bytes_per_epoch"],
            "autovm/measured_host_bytes": _moved(moved),
            "autovm/replans": self.replans,
        })
        if plan is not self._last_plan:
            self._last_plan = plan
            lines = []
            plan.summary(print_fn=lines.append)
            # Indented: markdown shows it as a preformatted block.
            self.writer.text(epoch, "autovm/plan",
                             "\n".join("    " + line for line in lines))


def _moved(moved):
    """Bytes moved both ways, from a mechanism's `moved_bytes()` (process
    totals; counts of tensors left out)."""
    if not moved:
        return None
    return sum(v for k, v in moved.items() if not k.endswith("_tensors"))


class EventWriter:
    """Appends scalars and text to one TensorBoard event file.

    Args:
        log_dir: the run's directory; made if missing.
    """

    def __init__(self, log_dir):
        os.makedirs(log_dir, exist_ok=True)
        name = (f"events.out.tfevents.{int(time.time())}."
                f"{socket.gethostname()}.{os.getpid()}.autovm")
        self.path = os.path.join(log_dir, name)
        self._write(_field(_EVENT_FILE_VERSION, b"brain.Event:2"), step=0)

    def scalars(self, step, values):
        """Writes `{tag: number}` at `step`; `None` values are skipped."""
        summary = b"".join(
            _field(1, _field(1, tag.encode()) + _float_field(2, value))
            for tag, value in values.items() if value is not None)
        if summary:
            self._write(_field(_EVENT_SUMMARY, summary), step)

    def text(self, step, tag, markdown):
        """Writes a text summary (markdown) at `step`."""
        metadata = _field(1, _field(1, b"text"))  # plugin_data.plugin_name
        tensor = (_varint_field(1, _DT_STRING) + _field(2, b"")
                  + _field(8, markdown.encode()))
        value = _field(1, tag.encode()) + _field(9, metadata) + _field(8, tensor)
        self._write(_field(_EVENT_SUMMARY, _field(1, value)), step)

    def _write(self, payload, step):
        event = (_double_field(_EVENT_WALL_TIME, time.time())
                 + _varint_field(_EVENT_STEP, step) + payload)
        length = struct.pack("<Q", len(event))
        # Opened for each record: a fit that fails leaves no file open.
        with open(self.path, "ab") as f:
            f.write(length + struct.pack("<I", _masked_crc(length))
                    + event + struct.pack("<I", _masked_crc(event)))


def _varint(n):
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number, data):
    """A length-delimited field (strings, bytes, messages)."""
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def _varint_field(number, value):
    return _varint(number << 3) + _varint(value)


def _double_field(number, value):
    return _varint(number << 3 | 1) + struct.pack("<d", value)


def _float_field(number, value):
    return _varint(number << 3 | 5) + struct.pack("<f", value)


def _crc_table():
    table = []
    for i in range(256):
        crc = i
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_CRC_TABLE = _crc_table()


def crc32c(data):
    """CRC-32C (Castagnoli), the checksum TFRecord framing uses."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked_crc(data):
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF
