"""Built-in selection strategies, shipped as plugins found through the same entry points as
any third-party plugin (import name `compressor_plugins`)."""
