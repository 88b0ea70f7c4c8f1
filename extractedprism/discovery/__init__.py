"""Where upstreams come from: the kube client, the EndpointSlice watch, slice parsing,
the merge of providers, watch backoff and the state file.
"""
