"""The write path: the DCP ``StorageWriter``, its destinations (local, multipart) and the parts each rank writes."""
