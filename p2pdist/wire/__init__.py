"""Sans-I/O codecs: frames, arrays and the connection handshake. No asyncio in here."""
