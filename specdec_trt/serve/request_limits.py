"""How much one request may ask of the server, importable by the command line without the server itself."""

DEFAULT_MAX_REQUEST_BYTES = 8 << 20  # 8 MiB: far past any prompt that fits a context of 100,000 tokens
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024  # each stop string's longest: the stop check scans this much text back at every token
