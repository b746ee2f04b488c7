"""The read path: the DCP ``StorageReader``, its copies and staging ring, span ownership and the exchange between ranks."""
