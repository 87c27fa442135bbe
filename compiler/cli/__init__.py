"""Every `kiln` command, imported statically by `main`; one module per command family."""
