"""One module per CLI command: options, progress and rendering. The maths lives in the library modules."""
