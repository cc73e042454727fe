"""What the coordinator and the worker must agree on: errors, schemas, tensor bytes.

Neither coordinator/ nor worker/ imports the other; both import this package.
"""
