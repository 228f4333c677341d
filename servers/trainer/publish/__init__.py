"""How a trainer's weights travel to rollout servers: one module per transfer method.

Each method is a :class:`~areal_servers.trainer.publish.base.Transport` (``stream``, ``disk``,
``distributed``); :class:`~areal_servers.trainer.weight_publisher.PublishSession` negotiates a
method with every server and drives the transports through one interface: ``offer`` during
negotiation, then ``open``, ``send`` per gathered bucket, ``close``.
"""
