-- Delete a stream's keys unless another replica holds its writer lease (took it over
-- while this one stalled): its log is that replica's now.
-- KEYS: the writer lease, then the others (redis_keys.stream_keys); ARGV: this replica's
-- token.
local holder = redis.call('get', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
return redis.call('del', unpack(KEYS))
