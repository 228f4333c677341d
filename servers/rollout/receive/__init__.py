"""How a rollout server takes new weights in: one module per transfer method.

Each method is a :class:`~areal_servers.rollout.receive.base.Receiver` (``stream``, ``disk``,
``distributed``) over the server's shared :class:`~areal_servers.rollout.receive.base.ReceiverState`
(the engine, the update lock, the plans, the spare receive buffers);
:class:`~areal_servers.rollout.weight_sync.WeightSyncServicer` negotiates a plan with the
sender through each receiver's ``accept`` and hands every update call to its receiver.
"""
