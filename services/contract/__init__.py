"""The ground floor: what every service must agree on, defined once, importing neither torch nor gRPC.

Each module is one shared truth; services import it and define none of it themselves
(README.md, "Who imports whom").
"""
