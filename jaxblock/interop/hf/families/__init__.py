"""One module per checkpoint family, each defining `FAMILY = Family(...)`; jaxblock.interop.hf.family
imports every module here on first use. Adding a family: docs/families.md."""
