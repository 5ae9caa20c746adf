"""The user's model read without running it: built from a factory by name and config (`factory.py`),
built abstractly with its parameters' roles (`abstract.py`), and a deep model read from shallow builds
(`depth.py`)."""
