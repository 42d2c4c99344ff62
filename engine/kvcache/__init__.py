"""KV memory: the paged KV pool, page allocator, req_to_token rows, radix (prefix) cache and page keys."""
