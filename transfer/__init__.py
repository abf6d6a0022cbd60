"""ckpt-ferry's library: on-store format, chunk codecs, stores and the transfer engine.

Layers (enforced by import-linter, see pyproject.toml): ``format`` <- ``codec`` <- ``store``
<- ``engine``. ``errors`` is shared by all of them.
"""
