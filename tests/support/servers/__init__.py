"""Real servers for remote-storage tests, all bound to 127.0.0.1 and stopped by their owners.

* :mod:`tests.support.servers.range_server`: an HTTP server that honours ``Range``, logs requests and
  injects faults (``StaticRangeServer`` serves a directory).
* :mod:`tests.support.servers.fake_hub`: a fake Hugging Face Hub (the endpoints ``HfFileSystem`` and
  ranged downloads use), on the same machinery.
* :mod:`tests.support.servers.s3`: moto's S3 server with its request recorder.
* :mod:`tests.support.servers.silent`: a server that accepts connections and never answers.
"""
