"""Scale-out of the two servers onto a distributed serving engine.

:mod:`mmferry.scaleout.ray` is a Ray Serve application (extra ``mmferry[ray]``): render
replicas on CPUs, encoder replicas on GPUs, each request routed to the encoder replica that
holds its items. :mod:`mmferry.scaleout.routing` is the routing decision as a pure function
(no Ray import)."""
