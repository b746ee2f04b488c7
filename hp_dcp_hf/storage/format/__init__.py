"""The safetensors format: headers, dtypes, the catalog of a checkpoint's files, byte ranges of boxes, the save journal."""
