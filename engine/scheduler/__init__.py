"""The co-located continuous-batching scheduler (the reference the PD path is compared against) and its Req."""
