"""I/O: lazy reading of source tensors, sharded atomic writing of the output, text and token inputs (``io.text``)."""

from mlaconv.io.reader import CheckpointReader, read_config, resolve_source
from mlaconv.io.writer import (ShardedWriter, atomic_output_dir, atomic_output_file, check_free_space,
                               check_output_target, parse_size)

__all__ = [
    "CheckpointReader", "ShardedWriter", "atomic_output_dir", "atomic_output_file", "check_free_space", "check_output_target",
    "parse_size", "read_config", "resolve_source",
]
