"""The commands: ``elasticep serve | join | generate`` (``cli`` dispatches to them).

Each command validates its flags, assembles a :class:`~elasticep.deploy.Deployment` and,
for ``serve`` and ``generate``, a front-end (``elasticep.frontend``) over it.
``batch_driver`` is ``generate --ep-size``'s front-end without HTTP.
"""
