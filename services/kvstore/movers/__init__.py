"""How a kvstore client moves block payloads to and from one node: one small class per way
(``base.Mover``), chosen per node by ``KvStoreClient`` in the order it is given, through the one
mover ladder of ``kvwire/movers.py``."""
