"""Memory-mapped token shards: the on-disk format of tokenized documents (see docs/format.md).

`ShardWriter` (`writer.py`) streams documents into shards; `ShardSource` (`source.py`) reads them
back as a Grain random-access data source; `format.py` holds the names and the manifest checks;
`reader.py` the slice readers the row builder uses; `record.py` the manifest's metadata
(`DatasetRecord`: its tokenizer and chat template), read and written in one place.
"""

from segpack.shards.format import (
    FORMAT_NAME, FORMAT_VERSION, MANIFEST_NAME, ShardFormatError, dtype_for_vocab)
from segpack.shards.record import ChatRecord, DatasetRecord, TokenizerRecord
from segpack.shards.source import ShardSource
from segpack.shards.writer import ShardWriter

__all__ = ["ChatRecord", "DatasetRecord", "FORMAT_NAME", "FORMAT_VERSION", "MANIFEST_NAME",
           "ShardFormatError", "ShardSource", "ShardWriter", "TokenizerRecord", "dtype_for_vocab"]
