"""What ``OffloadModel`` (``offload/model.py``) hands off, one job a file: where it computes and how
``.to()`` moves that (``placement.py``), the ``nn.Module`` reads that wait for pending host
updates first (``settled.py``), and its copies and pickles (``copying.py``). Nothing here is public: users reach it through ``OffloadModel``."""
