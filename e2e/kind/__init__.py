"""The kind suite: a real cluster, Gateway API + InferencePool CRDs, kgateway, the Helm chart."""
