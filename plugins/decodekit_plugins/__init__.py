"""decodekit's first-party plugins, written only against decodekit's public API."""
