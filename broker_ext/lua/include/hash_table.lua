-- TABLE_FIELD, TABLE_VALUE: a field that keeps a hash a hash table for good. Redis stores a hash of up
-- to 512 fields with values of up to 64 bytes as a listpack (hash-max-listpack-entries and -value, by
-- default), which every HSET, HSETNX and HGET of a field it does not hold scans from end to end: at a
-- few hundred acks records that scan was a tenth of a consumed message's Redis CPU. A value over 64
-- bytes converts the hash, and Redis never turns it back into a listpack. The field is a newline, which
-- no message id holds (publish and adopt refuse one), so no reader by id meets it.
local TABLE_FIELD = '\n'
local TABLE_VALUE = 'kept so that this hash stays a hash table: its value is over the 64 bytes of a listpack'
