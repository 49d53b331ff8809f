"""TensorBoard event files, written without TensorFlow.

A run logs scalars without importing TensorFlow (about 5 s of CPU on 2 cores, which
`flax.metrics.tensorboard` pays through `tf.summary`). An event file is a TFRecord file of `Event`
protos; the `tensorboard` package has both the protos and the record framing, and neither needs
TensorFlow. Scalars and text are written as `tf.summary` v2 writes them (a tensor with the
plugin's metadata), so TensorBoard shows them the same way.
"""

import os
import socket
import time

from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
from tensorboard.summary.writer.record_writer import RecordWriter

_SCALAR = summary_pb2.SummaryMetadata(
  plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name='scalars'),
  data_class=summary_pb2.DATA_CLASS_SCALAR,
)
_TEXT = summary_pb2.SummaryMetadata(
  plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name='text'),
  data_class=summary_pb2.DATA_CLASS_TENSOR,
)


class SummaryWriter:
  """`scalar`, `text`, `flush` and `close`, as flax.metrics.tensorboard.SummaryWriter has them;
  every event is on disk when the call returns.

  Each writer opens a new file, `events.out.tfevents.<time>.<host>.<pid>.<n>`, as TensorFlow
  names them: a resumed run adds a file beside the earlier ones, and TensorBoard reads them all.
  """

  _opened = 0

  def __init__(self, logdir: str):
    os.makedirs(logdir, exist_ok=True)
    SummaryWriter._opened += 1
    name = f'events.out.tfevents.{time.time():.0f}.{socket.gethostname()}.{os.getpid()}'
    self.path = os.path.join(logdir, f'{name}.{SummaryWriter._opened}')
    self._records = RecordWriter(open(self.path, 'ab'))
    self._write(event_pb2.Event(wall_time=time.time(), file_version='brain.Event:2'))

  def _write(self, event: event_pb2.Event) -> None:
    # Flushed at once: TensorBoard shows a running job live, and a killed one keeps its events
    # (a few small writes per logged step; tf.summary flushed every 2 minutes from a thread).
    self._records.write(event.SerializeToString())
    self._records.flush()

  def _summary(self, step: int, tag: str, metadata, tensor) -> None:
    value = summary_pb2.Summary.Value(tag=tag, metadata=metadata, tensor=tensor)
    summary = summary_pb2.Summary(value=[value])
    self._write(event_pb2.Event(wall_time=time.time(), step=int(step), summary=summary))

  def scalar(self, tag: str, value: float, step: int) -> None:
    tensor = tensor_pb2.TensorProto(
      dtype=types_pb2.DT_FLOAT, tensor_shape=tensor_shape_pb2.TensorShapeProto(), float_val=[value]
    )
    self._summary(step, tag, _SCALAR, tensor)

  def text(self, tag: str, text: str, step: int) -> None:
    tensor = tensor_pb2.TensorProto(
      dtype=types_pb2.DT_STRING,
      tensor_shape=tensor_shape_pb2.TensorShapeProto(),
      string_val=[text.encode('utf-8')],
    )
    self._summary(step, tag, _TEXT, tensor)

  def flush(self) -> None:
    self._records.flush()

  def close(self) -> None:
    if not self._records.closed:
      self._records.close()
